"""pytest plugin that runs llama.cpp's server tests (tools/server/tests) against `sapwood serve`.

Loaded by run.sh (`-p sapwood_llama_plugin`); it edits none of llama.cpp's files. It
- supplies a stand-in `wget` module when the package is missing (the suite imports it for
  model downloads, which cannot happen offline anyway);
- makes ServerPreset.load_all (the session-start download of every preset's model) a no-op;
- sends the suite's unprefixed OpenAI routes (/chat/completions, /completions, /models,
  /responses) to /v1/..., where an OpenAI client sends them (llama-server serves both);
- adds `"model": <the served name>` to an OpenAI request body that has none (the OpenAI API
  requires the field; llama-server, serving one model, does not), and has the tests' openai
  clients send the served name where a test names one of OpenAI's models (gpt-4.1, ...), which
  llama-server ignores, and /v1 where a test's base_url lacks it;
- where a test checks the protocol but also matches stories260K's text with a regular
  expression (MODEL_TEXT below), has match_regex accept any non-empty text: the protocol
  checks stay, the model's words are not sapwood's to match;
- skips, with the reason, every test that does not apply to an OpenAI-compatible server
  (FILES and TESTS below, by file or by test), and counts the rest at the end.
"""
import sys
import types
from fnmatch import fnmatchcase

import pytest

try:
    import wget  # noqa: F401
except ImportError:
    def _no_download(url, out=None):
        raise RuntimeError(f"offline: cannot download {url}")
    sys.modules["wget"] = types.SimpleNamespace(download=_no_download)

OPENAI_ROUTES = ("/chat/completions", "/completions", "/models", "/responses")

# whole files: llama.cpp-only routes or features
FILES = {
    "test_compat_anthropic.py": "Anthropic's /v1/messages API, not OpenAI's",
    "test_compat_gcp.py": "Google Vertex AI's prediction route (AIP_MODE), not OpenAI's",
    "test_ctx_shift.py": "llama.cpp's context shift (--context-shift)",
    "test_embedding.py": "embeddings: sapwood serves no embedding model",
    "test_infill.py": "llama.cpp's /infill (fill-in-the-middle) route",
    "test_kv_keep_only_active.py": "llama.cpp's KV-cache slot management",
    "test_lora.py": "LoRA adapters (/lora-adapters)",
    "test_mcp_servers.py": "llama.cpp's MCP server integration",
    "test_metrics.py": "llama.cpp's metric names (llamacpp:*) and --metrics switch",
    "test_proxy.py": "llama.cpp's /cors-proxy route",
    "test_rerank.py": "/rerank: sapwood serves no reranker",
    "test_router.py": "llama.cpp's multi-model router (/models/load, presets)",
    "test_sleep.py": "llama.cpp's --sleep-idle-seconds model unloading",
    "test_slot_save.py": "llama.cpp's /slots save/restore/erase",
    "test_speculative.py": "llama.cpp's draft flags (--spec-*, --model-draft) and native /completion",
    "test_stream.py": "llama.cpp's resumable /v1/stream route",
    "test_tokenize.py": "llama.cpp's /tokenize and /detokenize routes (not in the OpenAI API)",
    "test_tools_builtin.py": "llama.cpp's built-in server tools (/tools)",
    "test_vision_api.py": "multimodal input: sapwood is text only",
    "test_ignore_eos.py": "llama.cpp's ignore_eos field over native /completion",
    "test_template.py": "llama.cpp's /apply-template route and its built-in template names",
}

# single tests in the files that do apply: by name (any parametrisation), by name with its
# parameters, or by a pattern with "*"
NATIVE = "llama.cpp's native /completion route (content, n_predict, n_probs, /slots ...)"
FINGERPRINT = "asserts llama.cpp's system_fingerprint (b<build number>)"
TESTS = {
    "test_completion.py::test_completion": NATIVE,
    "test_completion.py::test_completion_stream": NATIVE,
    "test_completion.py::test_completion_stream_vs_non_stream": NATIVE,
    "test_completion.py::test_consistent_result_same_seed": NATIVE,
    "test_completion.py::test_different_result_different_seed": NATIVE,
    "test_completion.py::test_consistent_result_different_batch_size": NATIVE,
    "test_completion.py::test_cache_vs_nocache_prompt": NATIVE,
    "test_completion.py::test_nocache_long_input_prompt": NATIVE,
    "test_completion.py::test_json_prompt_no_mtmd": NATIVE,
    "test_completion.py::test_json_prompt_mtm_error_when_not_supported": NATIVE,
    "test_completion.py::test_completion_with_tokens_input": NATIVE,
    "test_completion.py::test_completion_parallel_slots": NATIVE,
    "test_completion.py::test_completion_unified": NATIVE,
    "test_completion.py::test_completion_response_fields": NATIVE,
    "test_completion.py::test_n_probs": NATIVE,
    "test_completion.py::test_n_probs_stream": NATIVE,
    "test_completion.py::test_n_probs_post_sampling": NATIVE,
    "test_completion.py::test_n_probs_post_backend_sampling": NATIVE,
    "test_completion.py::test_logit_bias": NATIVE,
    "test_completion.py::test_cancel_request": NATIVE,
    "test_completion.py::test_completion_prompt_cache": NATIVE,
    "test_completion.py::test_completion_with_openai_library": FINGERPRINT,
    "test_completion.py::test_completion_stream_with_openai_library_stops": "a real model's words (Phi-3.5, slow)",
    "test_chat_completion.py::test_chat_completion": "asserts stories260K's prompt token counts (69, 77, ...); " + FINGERPRINT,
    "test_chat_completion.py::test_chat_completion_cached_tokens": "asserts stories260K's token counts and llama.cpp's prefix-reuse counts",
    "test_chat_completion.py::test_chat_completion_stream": FINGERPRINT,
    "test_chat_completion.py::test_chat_completion_with_openai_library": FINGERPRINT,
    "test_chat_completion.py::test_chat_template": "llama.cpp's __verbose debug field and built-in llama3 template",
    "test_chat_completion.py::test_chat_template_assistant_prefill": "llama.cpp's __verbose debug field (the rendered prompt)",
    "test_chat_completion.py::test_chat_template_continue_final_message_vllm_compat": "llama.cpp's __verbose debug field (the rendered prompt)",
    "test_chat_completion.py::test_apply_chat_template": "llama.cpp's /apply-template route",
    "test_chat_completion.py::test_completion_with_response_format[response_format0-6-\"42\"]": "llama.cpp's schema inside response_format json_object (OpenAI's json_object takes none)",
    "test_chat_completion.py::test_completion_with_response_format[response_format1-10-[ -3000 ]]": "llama.cpp's schema inside response_format json_object (OpenAI's json_object takes none)",
    "test_chat_completion.py::test_completion_with_response_format[response_format5-0-None]": "an invalid schema inside json_object (llama.cpp's): sapwood's 400 would only say json_object takes no schema",
    "test_chat_completion.py::test_completion_with_response_format[response_format6-0-None]": "an invalid schema inside json_object (llama.cpp's): sapwood's 400 would only say json_object takes no schema",
    "test_chat_completion.py::test_completion_with_response_format[response_format7-0-None]": "an invalid schema inside json_object (llama.cpp's): sapwood's 400 would only say json_object takes no schema",
    "test_chat_completion.py::test_chat_template_continue_final_message_mutual_exclusion": "llama.cpp's (and vLLM's) add_generation_prompt / continue_final_message fields: sapwood refuses both as unknown, so its 400 says nothing of the rule tested",
    "test_chat_completion.py::test_completion_with_json_schema": "llama.cpp's top-level json_schema field (OpenAI: response_format; vLLM and sapwood: guided_json too)",
    "test_chat_completion.py::test_completion_with_grammar": "llama.cpp's grammar field (sapwood takes GBNF as vLLM's guided_grammar)",
    "test_chat_completion.py::test_completion_with_invalid_grammar": "llama.cpp's grammar field (its 400 here would only say the field is unknown)",
    "test_chat_completion.py::test_invalid_chat_completion_req[messages7]": "two assistant turns in a row: llama.cpp refuses them, OpenAI's API accepts them",
    "test_chat_completion.py::test_chat_completion_with_timings_per_token": "llama.cpp's timings_per_token field and timings object",
    "test_chat_completion.py::test_logit_bias": "llama.cpp's /tokenize route (and a logit_bias sapwood refuses, docs/server.md)",
    "test_chat_completion.py::test_context_size_exceeded": "llama.cpp's error type exceed_context_size_error and n_ctx field (OpenAI's: invalid_request_error, code context_length_exceeded, as sapwood answers)",
    "test_chat_completion.py::test_context_size_exceeded_stream": "llama.cpp's error type exceed_context_size_error and n_ctx field",
    "test_chat_completion.py::test_return_progress": "llama.cpp's return_progress field",
    "test_chat_completion.py::test_chat_completions_multiple_choices": "llama.cpp's id_slot field",
    "test_chat_completion.py::test_chat_completions_token_count": "llama.cpp's /chat/completions/input_tokens route",
    "test_chat_completion.py::test_verbose_debug": "llama.cpp's verbose field and __verbose output",
    # tool calls: the protocol checks apply with any model where tool_choice forces a call
    "test_tool_call.py::test_completion_with_required_tool_real_model*-code-*": "the bundled model never ends the python tool's free-text code argument within 512 tokens (a model's words, not the protocol: the boolean-argument rows pass)",
    "test_tool_call.py::test_*functionary*": "the functionary templates need bos_token, which the bundled model's tokenizer does not define",
    "test_tool_call.py::test_weather": "a real model's answer (the tool called unforced, with Istanbul)",
    "test_tool_call.py::test_calc_result": "a real model's answer (the calculation's result in words)",
    "test_tool_call.py::test_thoughts": "a real model's reasoning text",
    "test_tool_call.py::test_hello_world": "a real model's answer (an unforced python tool call)",
    "test_basic.py::test_server_multiple_addresses": "binds a comma-separated list of addresses (llama-server's --host); sapwood binds one",
    "test_basic.py::test_server_props": "llama.cpp's /props route",
    "test_basic.py::test_server_slots": "llama.cpp's /slots route",
    "test_basic.py::test_load_split_model": "loads a split GGUF from Hugging Face; native /completion",
    "test_basic.py::test_no_ui": "llama.cpp's web UI",
    "test_basic.py::test_server_model_aliases_and_tags": "llama.cpp's aliases and tags fields of /models",
    "test_security.py::test_access_static_assets_without_api_key": "llama.cpp's web UI assets",
    "test_security.py::test_incorrect_api_key": "asserts llama.cpp's error type authentication_error; OpenAI's 401 says invalid_request_error (code invalid_api_key), as sapwood does",
    "test_security.py::test_correct_api_key": "asserts llama.cpp's native field content in a /completions answer (OpenAI's is choices[].text)",
    "test_security.py::test_correct_api_key_anthropic_header": "Anthropic's X-Api-Key header; native field content",
    "test_security.py::test_cors_options": "llama-server answers CORS for any origin by default; sapwood's CORS is off unless --cors-origin names the origin",
    "test_security.py::test_cors_origins_localhost_reflects": "llama.cpp's --cors-origins localhost keyword (any loopback origin, any port)",
    "test_security.py::test_cors_origins_localhost_rejects": "llama.cpp's --cors-origins localhost keyword",
    "test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled": "llama.cpp's built-in tools and their CORS default",
    "test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": "llama.cpp's /cors-proxy route",
    "test_security.py::test_local_media_file": "multimodal input (local image files)",
    "test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": "llama.cpp's timings_per_token and return_progress fields",
}

# tests whose match_regex calls match the test model's text (see the docstring)
MODEL_TEXT = {
    "test_compat_oai_responses.py::test_responses_with_openai_library",
    "test_compat_oai_responses.py::test_responses_stream_with_openai_library",
    "test_completion.py::test_completion_stream_with_openai_library",
}

# OpenAI's model names the suite's openai clients send; llama-server serves any name
OPENAI_MODELS = {"gpt-3.5-turbo", "gpt-3.5-turbo-instruct", "gpt-4.1", "davinci-002"}

served = {"name": "default"}  # the name the running server answers to
not_applicable: set = set()  # node ids skipped as not applicable


def _nonempty(regex, text):
    return isinstance(text, str) and len(text) > 0


def _openai_client(base):
    class Client(base):
        """The suite's openai client, speaking to sapwood as an OpenAI client would."""

        def __init__(self, *a, base_url=None, **kw):
            if base_url is not None and not str(base_url).rstrip("/").endswith("/v1"):
                base_url = str(base_url).rstrip("/") + "/v1"
            super().__init__(*a, base_url=base_url, **kw)

        def _build_request(self, options, *a, **kw):
            body = options.json_data
            if isinstance(body, dict) and body.get("model") in OPENAI_MODELS:
                options.json_data = {**body, "model": served["name"]}
            return super()._build_request(options, *a, **kw)

    return Client


def pytest_collection_modifyitems(config, items):
    for item in items:
        fname = item.path.name
        full = f"{fname}::{item.name}"
        reason = (FILES.get(fname) or TESTS.get(full) or TESTS.get(f"{fname}::{item.originalname}")
                  or next((r for k, r in TESTS.items() if "*" in k and fnmatchcase(full, k)),
                          None))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"not applicable to sapwood: {reason}"))
            not_applicable.add(item.nodeid)
        module = getattr(item, "module", None)
        if module is not None and isinstance(getattr(module, "OpenAI", None), type) \
                and not getattr(module.OpenAI, "_sapwood", False):
            module.OpenAI = _openai_client(module.OpenAI)
            module.OpenAI._sapwood = True


@pytest.fixture(autouse=True)
def _model_text(request, monkeypatch):
    if f"{request.node.path.name}::{request.node.originalname}" in MODEL_TEXT:
        monkeypatch.setattr(request.module, "match_regex", _nonempty)
    yield


def pytest_sessionstart(session):
    import utils  # the suite's, on sys.path by its conftest

    utils.ServerPreset.load_all = staticmethod(lambda: None)

    make_url = utils.ServerProcess.make_url

    def v1_url(self, path, host=None):
        if path.split("?")[0].rstrip("/").startswith(OPENAI_ROUTES) and not path.startswith("/v1/"):
            path = "/v1" + path
        return make_url(self, path, host)

    def with_model(self, path, data):
        if (isinstance(data, dict) and "model" not in data
                and path.split("?")[0].lstrip("/").removeprefix("v1/")
                in ("chat/completions", "completions", "responses")):
            names = (self.model_alias or "default").split(",")
            data = {"model": names[0].strip(), **data}
        return data

    start = utils.ServerProcess.start

    def start_(self, *a, **kw):
        served["name"] = (self.model_alias or "default").split(",")[0].strip()
        return start(self, *a, **kw)

    utils.ServerProcess.start = start_
    make_request = utils.ServerProcess.make_request
    make_stream_request = utils.ServerProcess.make_stream_request

    def request(self, method, path, data=None, headers=None, *a, **kw):
        return make_request(self, method, path, with_model(self, path, data), headers, *a, **kw)

    def stream_request(self, method, path, data=None, headers=None, *a, **kw):
        return make_stream_request(self, method, path, with_model(self, path, data), headers,
                                   *a, **kw)

    utils.ServerProcess.make_url = v1_url
    utils.ServerProcess.make_request = request
    utils.ServerProcess.make_stream_request = stream_request


def pytest_terminal_summary(terminalreporter):
    st = terminalreporter.stats
    done = {r.nodeid: k for k in ("passed", "failed", "error", "skipped")
            for r in st.get(k, []) if getattr(r, "when", "call") in ("call", "setup")}
    ran = {n: k for n, k in done.items() if n not in not_applicable}
    count = {k: sum(v == k for v in ran.values()) for k in ("passed", "failed", "error", "skipped")}
    terminalreporter.write_line(
        f"sapwood: {count['passed']} of {len(ran) - count['skipped']} applicable tests passed "
        f"({count['failed']} failed, {count['error']} errors); {len(not_applicable)} not applicable; "
        f"{count['skipped']} skipped by the suite itself (slow, or marked so)")
