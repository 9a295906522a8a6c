#!/usr/bin/env bash
# Time `make demo` from a fresh clone until the curl it prints answers with generated text.
# usage: tests/bench/time_demo.sh [CLONE_DIR]   (default: a new temporary directory)
# Needs port 8086 free. Prints the seconds and the answer; stops the demo afterwards.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$(mktemp -d /var/tmp/viiwork-demo-XXXXXX)}
git clone -q "$repo" "$dir/clone"
cd "$dir/clone"
start=$(date +%s.%N)
setsid make demo > "$dir/demo.log" 2>&1 &
demo=$!  # leader of its own process group: make and the agent it runs
answer=""
for _ in $(seq 1 4000); do
    answer=$(curl -s --max-time 60 127.0.0.1:8086/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Say hello in five words."}], "max_tokens": 32}' \
        2>/dev/null || true)
    if grep -q '"content"' <<<"$answer"; then break; fi
    sleep 0.5
done
end=$(date +%s.%N)
echo "seconds until the printed curl answered: $(echo "$end - $start" | bc)"
echo "answer: $answer"
kill -INT -- "-$demo" 2>/dev/null || true
wait "$demo" 2>/dev/null || true
grep '^==>' "$dir/demo.log" || true
