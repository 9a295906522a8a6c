#!/usr/bin/env bash
# Capture llama-server's error answers verbatim (curl -i) for the client-fault classifier.
# usage: capture_errors.sh LLAMA_SERVER MODEL.gguf NAME OUTDIR [BUILD]
# NAME is the model's short name in the file names ("smollm2", "tiny"). Every file is
# "<BUILD>-<NAME>-<case>.txt", BUILD being the commit llama-server --version prints, or the
# 5th argument for builds that print "commit unknown" (built from a source package).
# The model must be a text-only GGUF (no --mmproj).
set -u
BIN=$1; MODEL=$2; NAME=$3; OUT=$4
VER=${5:-$("$BIN" --version 2>&1 | sed -n 's/.*commit \([0-9a-f]*\).*/\1/p')}
P=18233
pfx="$OUT/$VER-$NAME"
mkdir -p "$OUT"
start() { # args...
  "$BIN" --model "$MODEL" --alias err-model --host 127.0.0.1 --port $P --n-gpu-layers 0 --device none -t 1 "$@" >"$OUT/.srv.log" 2>&1 &
  SRV=$!
}
stop() { kill $SRV 2>/dev/null; for i in $(seq 40); do kill -0 $SRV 2>/dev/null || break; sleep 0.05; done; kill -9 $SRV 2>/dev/null; wait $SRV 2>/dev/null; }
wait_ready() { for i in $(seq 400); do kill -0 $SRV 2>/dev/null || { echo "llama-server died" >&2; return 1; }; [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$P/health)" = 200 ] && return 0; sleep 0.05; done; echo "not ready" >&2; return 1; }
post() { # path json outfile
  curl -s -i "http://127.0.0.1:$P$1" -H 'Content-Type: application/json' -d "$2" > "$3"
}
# A valid 1x1 PNG.
PNG=iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==
IMAGE_PART='{"type":"image_url","image_url":{"url":"data:image/png;base64,'$PNG'"}}'
AUDIO_PART='{"type":"input_audio","input_audio":{"data":"UklGRiQAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQAAAAA=","format":"wav"}}'
# About 3,000 tokens of text: far more than the 256-token context below.
LONG=$(printf 'the quick brown fox jumps over the lazy dog %.0s' $(seq 300))

# 1. a chat server with a small context: image and audio parts, and prompts longer than ctx
start -c 256 -np 1; wait_ready
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"text","text":"What is in this picture?"},'"$IMAGE_PART"']}],"max_tokens":8}' "$pfx-error_image_text_model.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"text","text":"What is in this picture?"},'"$IMAGE_PART"']}],"max_tokens":8,"stream":true}' "$pfx-error_image_text_model_stream.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"text","text":"What do you hear?"},'"$AUDIO_PART"']}],"max_tokens":8}' "$pfx-error_audio_text_model.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":"'"$LONG"'"}],"max_tokens":8}' "$pfx-error_context_overflow_chat.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":"'"$LONG"'"}],"max_tokens":8,"stream":true}' "$pfx-error_context_overflow_chat_stream.txt"
post /v1/completions '{"prompt":"'"$LONG"'","max_tokens":8}' "$pfx-error_context_overflow_completions.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"text","text":"What happens here?"},{"type":"video_url","video_url":{"url":"data:video/mp4;base64,AAAA"}}]}],"max_tokens":8}' "$pfx-error_video_text_model.txt"
# 400s the engine already answers as the client's: an unknown content part type, a bad field type
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"video","video":"x"}]}],"max_tokens":8}' "$pfx-error_unknown_part.txt"
post /v1/chat/completions '{"messages":"not a list","max_tokens":8}' "$pfx-error_messages_not_list.txt"
# 500s of llama-server's chat parsing that are the client's fault: a text part without text or
# with a number for it, tool_calls not a list, tools not a list of tools, an unknown reasoning format
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"text"}]}],"max_tokens":8}' "$pfx-error_text_part_no_text.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"text","text":5}]}],"max_tokens":8}' "$pfx-error_text_part_number.txt"
post /v1/chat/completions '{"messages":[{"role":"assistant","content":"hi","tool_calls":"x"},{"role":"user","content":"hi"}],"max_tokens":8}' "$pfx-error_tool_calls_not_list.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"tools":"x","max_tokens":8}' "$pfx-error_tools_not_list.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"tools":[5],"max_tokens":8}' "$pfx-error_tools_number.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"reasoning_format":"zz","max_tokens":8}' "$pfx-error_reasoning_format_chat.txt"
post /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"reasoning_format":"zz","max_tokens":8,"stream":true}' "$pfx-error_reasoning_format_chat_stream.txt"
post /v1/completions '{"prompt":"hi","reasoning_format":"zz","max_tokens":8}' "$pfx-error_reasoning_format_completions.txt"
stop

# 2. an embedding server: input longer than the batch, and the pooling refusal of a GGUF
#    without a pooling type (started without --pooling)
start -c 256 -np 1 -b 128 -ub 128 --embedding; wait_ready
post /v1/embeddings '{"input":"hello world","model":"err-model"}' "$pfx-error_embeddings_no_pooling.txt"
stop
start -c 256 -np 1 -b 128 -ub 128 --embedding --pooling mean; wait_ready
post /v1/embeddings '{"input":"'"$LONG"'","model":"err-model"}' "$pfx-error_embeddings_too_long.txt"
stop
rm -f "$OUT/.srv.log"
echo "captured with $("$BIN" --version 2>&1 | head -1)"
