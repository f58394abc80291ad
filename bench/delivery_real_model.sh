#!/bin/bash
# Model delivery on a real model (issue 35): a fresh client with only an invite connects to a
# `veil-trunk serve` of MODEL on this computer, downloads its part and chats; then again (the
# cache: nothing fetched), then the same prompt with the whole file given (same tokens?).
#   bench/delivery_real_model.sh /path/to/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [WORK_DIR]
# Everything it makes (keys, parts, the client's cache) stays in WORK_DIR (default a temp dir).
set -eu
MODEL=$1
W=${2:-$(mktemp -d)}
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD VEIL_KEYRING=file VEIL_DATA_DIR=$W/client-data
PROMPT="Write a Python function that reverses a string."
$PY -m remote.cli keygen --keys "$W/keys" --force > /dev/null
$PY -m remote.cli allow --keys "$W/keys" "$($PY -m app.cli --client-key)" > /dev/null
PORT=$($PY -c "from engine.local_server import free_port; print(free_port())")
INV=$($PY -m remote.cli invite --keys "$W/keys" --address "tcp://127.0.0.1:$PORT")
$PY -m remote.cli serve --model "$MODEL" --keys "$W/keys" --bind "tcp://127.0.0.1:$PORT" \
    --parts-dir "$W/parts" --quant auto > "$W/serve.out" 2> "$W/serve.err" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until grep -q READY "$W/serve.out"; do sleep 1; kill -0 $SERVER; done
for run in 1 2; do
    VEIL_CACHE_DIR=$W/client-cache $PY -m app.cli generate --server "$INV" --yes --json \
        --prompt "$PROMPT" --max-new-tokens 48 --decoder sequential > "$W/run$run.json"
done
VEIL_CACHE_DIR=$W/client-cache $PY -m app.cli generate --server "$INV" --model "$MODEL" --json \
    --prompt "$PROMPT" --max-new-tokens 48 --decoder sequential > "$W/whole.json"
$PY - "$W" "$MODEL" <<'PY'
import json, os, sys
w, model = sys.argv[1], sys.argv[2]
r1, r2, full = (json.load(open(f"{w}/{n}.json")) for n in ("run1", "run2", "whole"))
print(f"model file: {os.path.getsize(model):,} bytes")
print(f"first connect fetched: {r1['model_part']['fetched_bytes']:,} bytes "
      f"(part {r1['model_part']['part_bytes']:,}; local layers up to "
      f"{r1['model_part']['local_layers_max']})")
print(f"second connect fetched: {r2['model_part']['fetched_bytes']:,} bytes")
print("reply:", repr(r1["text"]))
print("tokens identical to the whole-file client:", r1["token_ids"] == full["token_ids"])
PY
