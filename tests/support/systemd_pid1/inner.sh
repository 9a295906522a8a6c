#!/bin/bash
# PID 1 of the new pid namespace: builds the container's root and API filesystems, then execs
# systemd. The root is overlay(lower = host /, upper = tmpfs): systemd-tmpfiles-setup runs
# with --remove --boot and would empty the host's /tmp on the real root. /proc/sys and /sys
# stay read-only so nothing in the container changes host kernel settings.
set -euo pipefail
R=$B/newroot
mount -n -t tmpfs tmpfs /run
mount -t tmpfs -o mode=755 tmpfs "$B/ovl"
mkdir -p "$B/ovl/upper" "$B/ovl/work"
mount -t overlay overlay -o "lowerdir=/,upperdir=$B/ovl/upper,workdir=$B/ovl/work" "$R"
mount -t proc proc "$R/proc"
mount --bind "$R/proc/sys" "$R/proc/sys" && mount -o remount,bind,ro "$R/proc/sys"
mount -t sysfs -o ro sysfs "$R/sys"
if [ "$CGMODE" = unified ]; then
  mount -t cgroup2 -o nsdelegate cgroup2 "$R/sys/fs/cgroup"
else
  mount -t tmpfs -o mode=755 tmpfs "$R/sys/fs/cgroup"
  mkdir -p "$R/sys/fs/cgroup/unified" "$R/sys/fs/cgroup/systemd"
  mount -t cgroup2 -o nsdelegate cgroup2 "$R/sys/fs/cgroup/unified"
  mount -t cgroup -o none,name=systemd cgroup "$R/sys/fs/cgroup/systemd"
  for c in ${V1:-}; do mkdir -p "$R/sys/fs/cgroup/$c"; mount -t cgroup -o "$c" cgroup "$R/sys/fs/cgroup/$c"; done
  mount -o remount,ro "$R/sys/fs/cgroup" 2>/dev/null || true
fi
mount -t tmpfs -o mode=755,nosuid,size=64m tmpfs "$R/dev"
for n in null zero full random urandom tty; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"; ln -s /proc/self/fd "$R/dev/fd"
ln -s /proc/self/fd/0 "$R/dev/stdin"; ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm"
touch "$B/console.log" "$R/dev/console"; mount --bind "$B/console.log" "$R/dev/console"
# The container's /run is $B/run on the host: its system bus socket and journal are visible there.
mount --bind "$B/run" "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
if [ -n "${SHARE:-}" ]; then mkdir -p "$R$SHARE_INSIDE"; mount --bind "$SHARE" "$R$SHARE_INSIDE"; fi
E=$R/etc/systemd/system
mkdir -p "$E"
cat > "$E/viiwork-test.target" <<'EOT'
[Unit]
Description=viiwork test boot target (basic system, D-Bus, journald)
Requires=basic.target
After=basic.target
Wants=dbus.socket
AllowIsolate=yes
EOT
# Units that touch hardware, the network or timers: nothing a test needs.
for u in systemd-modules-load.service systemd-sysctl.service systemd-binfmt.service \
         proc-sys-fs-binfmt_misc.automount systemd-tmpfiles-setup-dev.service kmod-static-nodes.service \
         systemd-firstboot.service systemd-repart.service systemd-remount-fs.service \
         systemd-timesyncd.service systemd-networkd.service systemd-resolved.service systemd-logind.service \
         getty@tty1.service console-getty.service apt-daily.timer apt-daily-upgrade.timer \
         dpkg-db-backup.timer e2scrub_all.timer fstrim.timer man-db.timer postgresql.service; do
  ln -sf /dev/null "$E/$u"
done
echo viiwork-test > "$R/etc/hostname" 2>/dev/null || true
cd "$R"
exec unshare --root="$R" --wd=/ env container=viiwork-test /lib/systemd/systemd \
  --unit=viiwork-test.target --show-status=no
