#!/usr/bin/env bash
# Capture llama-server responses verbatim (curl -i) for the adapter's replay tests.
# usage: capture.sh LLAMA_SERVER SMOLLM2.gguf TINY.gguf OUTDIR
# SmolLM2 (Q4_1) is used only for /health while loading: on CPUs without AVX-VNNI this
# build dies with SIGILL in its Q4_1 kernel at warm-up, after the loading window. The rest
# uses the project's tiny F32 model (tests/support/tiny_gguf.py), which runs anywhere.
set -u
BIN=$1; SMOL=$2; TINY=$3; OUT=$4
MODEL=$SMOL
VER=$("$BIN" --version 2>&1 | sed -n 's/.*commit \([0-9a-f]*\).*/\1/p')
P=18231
pfx="$OUT/$VER-smollm2"
tpfx="$OUT/$VER-tiny"
mkdir -p "$OUT"
start() { # args...
  "$BIN" --model "$MODEL" --alias tiny-model --host 127.0.0.1 --port $P --n-gpu-layers 0 --device none -t 1 "$@" >"$OUT/.srv.log" 2>&1 &
  SRV=$!
}
# llama-server hangs on SIGTERM with a request in flight: escalate to SIGKILL after 2 s
stop() { kill $SRV 2>/dev/null; for i in $(seq 40); do kill -0 $SRV 2>/dev/null || break; sleep 0.05; done; kill -9 $SRV 2>/dev/null; wait $SRV 2>/dev/null; }
wait_ready() { for i in $(seq 200); do [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$P/health)" = 200 ] && return 0; sleep 0.05; done; return 1; }
get() { curl -s -i "http://127.0.0.1:$P$1" > "$2"; }
long_req() { curl -s -o /dev/null http://127.0.0.1:$P/v1/chat/completions -H 'Content-Type: application/json' -d '{"messages":[{"role":"user","content":"Write a long story about the sea."}],"max_tokens":3000,"ignore_eos":true}' & }

# 1. /health while the model loads: poll as fast as curl goes, keep the first 503 verbatim
start -c 2048 -np 2 --metrics
for i in $(seq 2000); do
  curl -s -i http://127.0.0.1:$P/health > "$OUT/.h" 2>/dev/null || continue
  if head -1 "$OUT/.h" | grep -q ' 503 '; then
    cp "$OUT/.h" "$pfx-health_loading.txt"
    get /slots "$pfx-slots_loading.txt"; get /metrics "$pfx-metrics_loading.txt"; break
  fi
  if head -1 "$OUT/.h" | grep -q ' 200 '; then echo "missed the loading window"; break; fi
done
stop
MODEL=$TINY

# 2. /slots idle with parallel=1 and parallel=4; metrics with deferred requests at parallel=1
start -c 4096 -np 1 --metrics; wait_ready
get /slots "$tpfx-slots_np1_idle.txt"
long_req; long_req; long_req
for i in $(seq 100); do curl -s http://127.0.0.1:$P/metrics | grep -q '^llamacpp:requests_deferred [1-9]' && break; sleep 0.05; done
get /metrics "$tpfx-metrics_np1_deferred.txt"
get /slots "$tpfx-slots_np1_busy.txt"
get /health "$tpfx-health_np1_busy.txt"
stop; wait

start -c 4096 -np 4; wait_ready
get /slots "$tpfx-slots_np4_idle.txt"
get /metrics "$tpfx-metrics_disabled.txt"
stop

# 3. /slots disabled
start -c 1024 -np 2 --no-slots; wait_ready
get /slots "$tpfx-slots_disabled.txt"
stop

# 4. embeddings: a chat server refuses them; an --embedding server serves them
start -c 1024 -np 2; wait_ready
curl -s -i http://127.0.0.1:$P/v1/embeddings -H 'Content-Type: application/json' -d '{"input":"hello world","model":"tiny-model"}' > "$tpfx-embeddings_chat_server.txt"
stop
start -c 1024 -np 2 --embedding; wait_ready
curl -s -i http://127.0.0.1:$P/v1/embeddings -H 'Content-Type: application/json' -d '{"input":"hello world","model":"tiny-model"}' > "$tpfx-embeddings.txt"
get /slots "$tpfx-slots_embedding.txt"
stop
rm -f "$OUT/.h" "$OUT/.srv.log"
echo "captured with $("$BIN" --version 2>&1 | head -1)"
