#!/bin/sh
# Run llama.cpp's server test suite against `sapwood serve`.
#   scripts/llama_server_suite/run.sh LLAMA_CPP/tools/server/tests [pytest args...]
# PYTHON: the interpreter that has sapwood[server] and pytest (default: python3).
set -e
tests=${1:?usage: run.sh LLAMA_CPP/tools/server/tests [pytest args...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
py=$(command -v "$PYTHON")
export SAPWOOD_PYTHON="$py"
export LLAMA_SERVER_BIN_PATH="$here/llama-server"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
cd "$tests"
[ $# -gt 0 ] || set -- unit  # slow tests too: with the bundled model they are quick
exec "$py" -m pytest -p sapwood_llama_plugin -p no:cacheprovider -q -rs "$@"
