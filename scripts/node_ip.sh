#!/usr/bin/env bash
# Print an IPv4 address of this node, chosen explicitly.
#
#   node_ip.sh --ifname IFACE    the address of interface IFACE (e.g. bond0, ib0)
#   node_ip.sh --route-to HOST   the local address the kernel uses to reach HOST
#   node_ip.sh                   the first non-loopback address `hostname` resolves to
#
# Needs only bash and python3 (standard library).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
mode=hostname
arg=""
case "${1:-}" in
    --ifname | --route-to)
        [[ $# -ge 2 ]] || { echo "node_ip.sh: $1 needs a value" >&2; exit 2; }
        mode="${1#--}"
        arg="$2"
        ;;
    "") ;;
    -h | --help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "node_ip.sh: unknown option $1" >&2; exit 2 ;;
esac

exec "$PYTHON" - "$mode" "$arg" <<'PY'
import fcntl, socket, struct, sys

mode, arg = sys.argv[1], sys.argv[2]
try:
    if mode == "ifname":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", arg[:15].encode()))  # SIOCGIFADDR
        print(socket.inet_ntoa(packed[20:24]))
    elif mode == "route-to":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((arg, 9))  # UDP connect sends nothing; it only picks a route
        print(s.getsockname()[0])
    else:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        addrs = [i[4][0] for i in infos if not i[4][0].startswith("127.")]
        if not addrs:
            sys.exit("node_ip.sh: hostname resolves only to loopback; use --ifname IFACE")
        print(addrs[0])
except OSError as e:
    sys.exit(f"node_ip.sh: cannot find an IPv4 address ({mode} {arg}): {e}")
PY
