#!/usr/bin/env bash
# Run llama.cpp's server (`make llama-server`) on a GGUF file, as the outside reference of
# `kvmesh bench serve --compare colocated,disagg,llama-server=http://127.0.0.1:PORT`
# (docs/load.md): CPU only, continuous batching, 8 slots sharing CTX tokens of context.
#
#   [THREADS=2] [CTX=24576] scripts/llama_server.sh MODEL.gguf PORT [more llama-server flags]
#
# It stays in the foreground until stopped; http://127.0.0.1:PORT/health answers 200 when ready.
set -euo pipefail
if [[ $# -lt 2 ]]; then
    echo "usage: [THREADS=2] [CTX=24576] $0 MODEL.gguf PORT [more llama-server flags]" >&2
    exit 2
fi
model=$1 port=$2
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
server=${LLAMA_SERVER:-$here/.venv/bin/llama-server}
if [[ ! -x $server ]]; then
    echo "$server is missing: build it with \`make llama-server\` (minutes)" >&2
    exit 1
fi
# 8 slots (-np), each with CTX / 8 tokens of context; -t / -tb: threads for decode and for
# prompt batches, as kvmesh's workers get on the same cores; no GPU layers, no web UI.
exec "$server" -m "$model" --host 127.0.0.1 --port "$port" -t "${THREADS:-2}" \
    -tb "${THREADS:-2}" -np 8 -c "${CTX:-24576}" --cont-batching -ngl 0 --no-webui --metrics "$@"
