#!/bin/bash
# Started by support/systemd.py (pid1_system): boots a real systemd as PID 1 of new pid, mount,
# cgroup, uts, ipc (and, unless NET=host, net) namespaces. Never on the host's root: inner.sh
# gives it an overlay whose upper layer is a tmpfs.
#
# Environment: B (scratch dir, required), NAME (cgroup name, required), V1 (v1 controllers to
# hand over, e.g. "memory pids": makes MemoryMax/TasksMax enforced), NET ("host" to share the
# host's network namespace), SHARE (a host dir bound at SHARE_INSIDE in the container).
set -euo pipefail
: "${B:?}" "${NAME:?}"
mkdir -p "$B/run" "$B/newroot" "$B/ovl"
# Our own cgroups, so the container's systemd owns a subtree and teardown finds everything.
# Hybrid hosts (cgroup v1 + a unified mount): unified and name=systemd, plus the V1
# controllers. Pure cgroup v2 hosts: one cgroup; its controllers come with it, V1 is unused.
if [ -e /sys/fs/cgroup/cgroup.controllers ]; then
  CGMODE=unified
  mkdir -p "/sys/fs/cgroup/$NAME"; echo $$ > "/sys/fs/cgroup/$NAME/cgroup.procs"
else
  CGMODE=hybrid
  for h in unified systemd; do
    mkdir -p "/sys/fs/cgroup/$h/$NAME"; echo $$ > "/sys/fs/cgroup/$h/$NAME/cgroup.procs"
  done
  for c in ${V1:-}; do
    cur=$(awk -F: -v c="$c" '$2==c {print $3}' /proc/self/cgroup)
    d="/sys/fs/cgroup/$c${cur%/}/$NAME"
    mkdir -p "$d"; echo $$ > "$d/cgroup.procs"
  done
fi
net=--net
[ "${NET:-}" = host ] && net=
exec unshare --pid --fork --kill-child --mount --cgroup --uts --ipc $net --propagation private \
  env -i B="$B" CGMODE="$CGMODE" V1="${V1:-}" SHARE="${SHARE:-}" SHARE_INSIDE="${SHARE_INSIDE:-}" PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  bash "$(dirname "$0")/inner.sh"
