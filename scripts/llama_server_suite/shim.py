"""llama-server's command line as `sapwood serve`, for llama.cpp's server test suite.

llama.cpp's tests (tools/server/tests/utils.py, ServerProcess.start) run the binary named by
LLAMA_SERVER_BIN_PATH with llama-server's flags. This shim maps the flags that have a
`sapwood serve` counterpart and drops the rest, saying so on stderr. Model selection
(--hf-repo, --model, ...) is dropped: sapwood serves its bundled default pair. Run it through
run.sh, which also loads the suite plugin (sapwood_llama_plugin.py).
"""
import os
import sys

# llama-server flags that take a value, and the `sapwood serve` option each becomes (None: dropped)
VALUED = {
    "--host": "--host", "--port": "--port", "--api-key": "--api-key",
    "--parallel": "--parallel", "-np": "--parallel",
    "--ctx-size": None, "-c": None,  # handled below: llama's n_ctx is shared by the slots
    "--threads": "--threads", "-t": "--threads",
    "--alias": None, "-a": None,  # handled below: comma-separated names
    "--chat-template-file": "--chat-template",
    "--chat-template": None, "--reasoning-format": None, "--cors-origins": None,
    # model selection: sapwood serves its bundled default model
    "--model": None, "-m": None, "--model-url": None, "--hf-repo": None, "-hf": None,
    "-hfr": None, "--hf-file": None, "-hff": None, "--model-draft": None, "-md": None,
    "--models-dir": None, "--models-max": None, "--models-preset": None, "--mmproj-url": None,
    # llama.cpp tuning and features without a sapwood counterpart
    "--temp": None, "--seed": None, "-s": None, "--n-predict": None, "-n": None,
    "--batch-size": None, "-b": None, "--ubatch-size": None, "-ub": None,
    "--n-gpu-layers": None, "-ngl": None, "-ctk": None, "-ctv": None, "-fa": None,
    "--pooling": None, "--tags": None, "--slot-save-path": None, "--grp-attn-n": None,
    "--grp-attn-w": None, "--lora": None, "--spec-type": None, "--spec-draft-n-max": None,
    "--spec-draft-n-min": None, "--spec-synth-len": None, "--spec-synth-rates": None,
    "--reasoning": None, "--media-path": None, "--sleep-idle-seconds": None,
    "--cache-ram": None, "--tools": None, "--tools-runtime": None,
    "--mcp-servers-config": None, "--mcp-servers-json": None,
}
# llama.cpp's built-in template names that sapwood has too
TEMPLATES = {"chatml": "chatml"}


def translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`sapwood serve` arguments, notes on what was dropped)."""
    out, notes, vals = [], [], {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in VALUED:
            v = argv[i + 1] if i + 1 < len(argv) else ""
            i += 2
            vals[a] = v
            if VALUED[a] is not None:
                out += [VALUED[a], v]
            elif a in ("--ctx-size", "-c", "--alias", "-a", "--chat-template",
                       "--reasoning-format", "--cors-origins"):
                pass
            else:
                notes.append(f"{a} {v}")
            continue
        i += 1
        notes.append(a)  # a switch: --jinja, --no-slots, --metrics, --offline, ...
    if "--host" in vals:  # llama-server binds a comma-separated list; sapwood one address
        hosts = vals["--host"].split(",")
        out[out.index("--host") + 1] = hosts[0].strip()
        if len(hosts) > 1:
            notes.append(f"--host {vals['--host']} (only {hosts[0].strip()} bound)")
    ctx = vals.get("--ctx-size", vals.get("-c"))
    if ctx:  # llama-server: the context of all slots together (without --kv-unified)
        slots = int(vals.get("--parallel", vals.get("-np", "1")) or 1)
        n = int(ctx) // max(slots, 1) if "--kv-unified" not in argv else int(ctx)
        if n > 0:
            out += ["--max-context", str(n)]
    alias = vals.get("--alias", vals.get("-a"))
    if alias:
        names = [n.strip() for n in alias.split(",") if n.strip()]
        out += ["--served-model-name", *names]
    tpl = vals.get("--chat-template")
    if tpl:
        if tpl in TEMPLATES:
            out += ["--chat-template", TEMPLATES[tpl]]
        else:
            notes.append(f"--chat-template {tpl} (not a template sapwood has built in)")
    fmt = vals.get("--reasoning-format")
    if fmt:
        out += ["--reasoning-parser", "none" if fmt == "none" else "qwen3"]
    cors = vals.get("--cors-origins")
    if cors:
        for o in cors.split(","):
            if o.strip():
                out += ["--cors-origin", o.strip()]
    return out, notes


def main() -> None:
    args, notes = translate(sys.argv[1:])
    if notes:
        print("llama-server shim: dropped (no sapwood counterpart): " + " ".join(notes),
              file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "sapwood", "serve", *args]
    print("llama-server shim: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    main()
