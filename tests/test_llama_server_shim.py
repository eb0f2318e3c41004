"""scripts/llama_server_suite/shim.py: llama-server's flags, as llama.cpp's server tests pass
them (tools/server/tests/utils.py), become `sapwood serve` options; the rest is dropped and
said so."""
import importlib.util
from pathlib import Path

SHIM = Path(__file__).resolve().parents[1] / "scripts" / "llama_server_suite" / "shim.py"


def _shim():
    spec = importlib.util.spec_from_file_location("llama_server_shim", SHIM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_suites_flags_become_sapwood_serve_options():
    argv = ("--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1,::1 --hf-repo ggml-org/m "
            "--no-slots --alias tinyllama-2,fim --ctx-size 512 --parallel 2 --n-predict 64 "
            "--api-key sk-x --jinja --chat-template-file t.jinja --reasoning-format none "
            "--cors-origins http://a.example,http://b.example").split()
    args, notes = _shim().translate(argv)
    assert args == ["--port", "8080", "--host", "127.0.0.1", "--parallel", "2",
                    "--api-key", "sk-x", "--chat-template", "t.jinja",
                    "--max-context", "256", "--served-model-name", "tinyllama-2", "fim",
                    "--reasoning-parser", "none", "--cors-origin", "http://a.example",
                    "--cors-origin", "http://b.example"]
    assert notes == ["--temp 0.8", "--seed 42", "--hf-repo ggml-org/m", "--no-slots",
                     "--n-predict 64", "--jinja",
                     "--host 127.0.0.1,::1 (only 127.0.0.1 bound)"]


def test_unified_kv_keeps_the_whole_context_and_only_chatml_is_a_named_template():
    args, notes = _shim().translate("--ctx-size 512 -np 4 --kv-unified --chat-template llama3"
                                    .split())
    assert args == ["--parallel", "4", "--max-context", "512"]
    assert notes == ["--kv-unified", "--chat-template llama3 (not a template sapwood has built in)"]
    assert _shim().translate(["--chat-template", "chatml"])[0] == ["--chat-template", "chatml"]
