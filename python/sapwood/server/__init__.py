"""`sapwood serve`: an OpenAI-compatible server (docs/server.md). Needs the `server` extra:
pip install "sapwood[server]"."""
from __future__ import annotations

import os

from ..chat_template import compile_chat_template, template_for

_EXTRA = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def missing_extra() -> list:
    """The server extra's packages that cannot be imported here."""
    import importlib.util

    return [m for m in _EXTRA if importlib.util.find_spec(m) is None]


def _require_extra() -> None:
    gone = missing_extra()
    if gone:
        raise ImportError(f"sapwood serve needs the server extra, missing here: {', '.join(gone)}."
                          ' Install it with: pip install "sapwood[server]" (from a checkout:'
                          ' pip install ".[server]")')


_require_extra()

from .access import check_api_key, check_origins  # noqa: E402
from .admit import DEFAULT_MAX_BODY_MB  # noqa: E402
from .app import ServerState, create_app  # noqa: E402
from .batching import VerifyBatcher  # noqa: E402
from .slots import Scheduler, SnapshotCache, Slot  # noqa: E402
from .text import token_bytes_table  # noqa: E402

__all__ = ["build", "create_app", "default_parallel", "run", "start", "ServerState"]


SLOT_THREADS = 2  # cores a slot is counted as needing when --threads is not given
MAX_DEFAULT_PARALLEL = 4


def default_parallel(cores: int, free_bytes: int, shared_bytes: int, per_slot_bytes: int,
                     threads=None) -> tuple[int, str]:
    """The slot count `sapwood serve` takes without --parallel, and why, in one line:
    min(cores // threads a slot, the slots the free memory holds beside the shared weights,
    4). A slot is a sequence of its own (KV, GDN state, round buffers: per_slot_bytes,
    MemoryEstimate.per_sequence) over the one copy of the weights (shared_bytes). Two cores
    a slot unless --threads says otherwise, a starting point rather than a measured optimum:
    a 2-core host keeps one slot with both cores (more slots raised no aggregate tokens/s
    there, bench/results/xeon_amx/serve_load.md). At most 4: more slots share the memory
    bandwidth each decode step is bound by (docs/server.md, "Slots")."""
    for name, v in (("cores", cores), ("per_slot_bytes", per_slot_bytes),
                    ("threads", 1 if threads is None else threads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an int >= 1")
    per = SLOT_THREADS if threads is None else threads
    by_cores = max(1, cores // per)
    by_memory = max(1, (free_bytes - shared_bytes) // per_slot_bytes)
    n = min(by_cores, by_memory, MAX_DEFAULT_PARALLEL)
    gb = 1e9
    return n, (f"--parallel {n} (the default: the least of {cores} cores // {per} threads a "
               f"slot = {by_cores}; {free_bytes / gb:.1f} GB free holds {by_memory} slots of "
               f"{per_slot_bytes / gb:.2f} GB beside {shared_bytes / gb:.2f} GB shared "
               f"(weights, runtime); {MAX_DEFAULT_PARALLEL}, the most by default)")


def machine_parallel(model, *, weights: str, kv: str, max_context: int, threads=None):
    """default_parallel for this machine and `model` (a checkpoint directory or "default"),
    from its config.json alone: nothing is loaded."""
    from ..loading import default_target_path
    from ..memory import available_bytes, estimate

    d = default_target_path() if model == "default" else model
    est = estimate(d, weights=weights, kv=kv, max_context=max_context)  # "auto" resolved
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return default_parallel(cores or 1, available_bytes(), est.total - est.per_sequence,
                            est.per_sequence, threads)


def _slot_threads(threads, parallel: int):
    """Engine threads per slot: as asked, else the cores shared out between the slots (one
    engine's default is every core; N of them would each start that many)."""
    if threads is not None or parallel == 1:
        return threads
    return max(1, (os.cpu_count() or 1) // parallel)


def build(model="default", *, drafter=None, parallel: int = 1, max_context: int = 4096,
          cache_mb: float = 256, max_queue: int = 64, weights: str = "auto", kv: str = "int8",
          backend: str = "cpu", threads=None, model_id: str | None = None,
          loader=None, batch_verify: bool = False,
          max_body_mb: float = DEFAULT_MAX_BODY_MB, api_key: str | None = None,
          cors_origins=(), chat_template: str | None = None, reasoning_parser: str = "auto",
          aliases=()) -> ServerState:
    """Load `parallel` slots of `model` and return the server state create_app serves.

    drafter: None (the model's attached draft, else its MTP head when the checkpoint has one,
    else prompt lookup), "mtp", "lookup", "default" or a draft checkpoint directory. Slot 0 loads
    the model; the others are its new_sequence()s (one copy of the weights, and of the draft
    model's). loader(i) -> Model replaces that for slot i (tests).
    batch_verify: the decoding slots' verify rounds run in one forward (batching.py); off by
    default: on the 2-core CPU hosts measured it did not raise tokens/s (docs/server.md).
    max_body_mb: the largest request body accepted (MiB); a larger one gets 413 before it is
    read (docs/server.md).
    api_key: requests must send `Authorization: Bearer KEY` (401 otherwise; /health stays open);
    None: the environment's SAPWOOD_API_KEY if set, else no key. cors_origins: origins whose
    browser pages may call the API ("*": any); empty: CORS off (server/access.py).
    chat_template: Jinja source that replaces the checkpoint's template; None: the checkpoint's,
    else ChatML with a warning (chat_template.template_for, the Python API's rule too).
    reasoning_parser: "qwen3" splits <think>...</think> into reasoning_content, "none" leaves
    it in content, "auto" (default) splits when the chat template writes thinking blocks
    (Qwen3.5's does; server/reasoning.py). aliases: more names clients may send for the
    model (vLLM's --served-model-name NAME ALIAS...); responses name model_id.
    """
    import sapwood

    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}: must be an int >= 1")
    if not cache_mb >= 0:
        raise ValueError(f"cache_mb={cache_mb!r}: must be >= 0 (0 turns snapshots off)")
    if not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue={max_queue!r}: must be an int >= 0")
    if isinstance(max_body_mb, bool) or not isinstance(max_body_mb, (int, float)) \
            or not 0 < max_body_mb < 2 ** 20:
        raise ValueError(f"max_body_mb={max_body_mb!r}: must be a number of MiB in (0, 2**20)")
    if api_key is None:  # the environment keeps a key out of `ps` and shell history
        api_key = os.environ.get("SAPWOOD_API_KEY") or None
    if api_key is not None:
        check_api_key(api_key)
    cors_origins = check_origins(cors_origins)  # all three before the slots load: fail fast
    if chat_template is not None:
        compile_chat_template(chat_template)  # a syntax error: ValueError naming its line
    n_threads = _slot_threads(threads, parallel)
    cache = SnapshotCache(int(cache_mb * 2 ** 20))
    base = []  # slot 0's (model, draft): the later slots are their new_sequence()s
    batcher = VerifyBatcher() if batch_verify and parallel > 1 else None

    def make_slot(i, on_done):
        if loader is not None:
            m = loader(i)
        elif base:  # one copy of the weights for every slot, each its own sequence state
            m = base[0][0].new_sequence()
        else:
            m = sapwood.load(model, weights=weights, kv=kv, backend=backend, threads=n_threads,
                             max_context=max_context)
        if m.tokenizer is None:
            raise ValueError(f"{m.path}: no tokenizer.json; the server needs a tokenizer")
        if chat_template is not None:
            m.chat_template = chat_template
        # the API's rule (one warning at start, not one a request): the later slots copy it
        m.chat_template = template_for(m.chat_template, m.path or model)
        draft = m.draft
        if drafter == "mtp":
            m.resolve_drafter("mtp")  # a checkpoint without a head fails here, at start
        elif drafter not in (None, "lookup"):
            if base and loader is None and base[0][1] is not None:
                draft = base[0][1].new_sequence()
            else:  # loads the draft checkpoint
                draft = m.resolve_drafter(drafter).model
        if not base:
            base.append((m, draft))
        if drafter in ("lookup", "mtp"):
            default = drafter
        else:  # as Model.resolve_drafter(None): the draft model, else the MTP head, else lookup
            default = "model" if draft is not None else "mtp" if m.mtp is not None else "lookup"
        return Slot(i, m, draft, default, cache, on_done, batcher)

    done = []
    scheduler = Scheduler(make_slot, parallel, cache, max_queue,
                          on_done=lambda slot, r: done[0](slot, r))
    first = scheduler.slots[0].model
    name = model_id or (model if model == "default" else
                        (first.path.name if first.path is not None else "model"))
    st = ServerState(scheduler, cache, name, token_bytes_table(first.tokenizer),
                     max_body_bytes=max(1, int(max_body_mb * 2 ** 20)), api_key=api_key,
                     cors_origins=cors_origins, reasoning_parser=reasoning_parser,
                     aliases=aliases)
    done.append(lambda slot, r: st.metrics.choice_done(r))
    return st


def run(st: ServerState, host: str = "127.0.0.1", port: int = 8080, log_level: str = "warning",
        announce=print) -> None:
    """Serve until interrupted."""
    import uvicorn

    shown = f"[{host}]" if ":" in host else host

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # bound: the URL works now
                bound = port
                if not bound and self.servers and self.servers[0].sockets:  # --port 0: a free one
                    bound = self.servers[0].sockets[0].getsockname()[1]
                announce(f"sapwood serve: http://{shown}:{bound}/v1  (model {st.model_id!r}, "
                         f"{len(st.scheduler.slots)} slot(s), context {st.max_context}, "
                         f"snapshot cache {st.cache.budget / 2 ** 20:.0f} MiB"
                         f"{', API key required' if st.api_key else ''})", flush=True)

    server = _Server(uvicorn.Config(create_app(st), host=host, port=port, log_level=log_level))
    try:
        server.run()
    finally:
        st.close()


class Running:
    """A server started by `start`: its `url` (http://host:port) and `close()`."""

    def __init__(self, st: ServerState, host: str, port: int, log_level: str):
        import socket
        import threading
        import time

        import uvicorn

        self.st = st
        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose
        # proto says TCP, and without it a response written as head then body waited for the
        # client's delayed ACK, 40 ms per request on a kept-alive connection (uvicorn's own
        # sockets, `sapwood serve`, come from getaddrinfo and say so)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        self._uv = uvicorn.Server(uvicorn.Config(create_app(st), log_level=log_level))
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [sock]},
                                        name="sapwood-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self._uv.should_exit = True
        self._thread.join(timeout=30)
        self.st.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start(st: ServerState, host: str = "127.0.0.1", port: int = 0,
          log_level: str = "error") -> Running:
    """Serve `st` from a background thread of this process (port 0: a free one) until
    close(): tests and benchmarks talk to it over real HTTP."""
    return Running(st, host, port, log_level)
