#!/usr/bin/env bash
# netns-down.sh -- kill what still runs in the namespaces of netns-up.sh, remove them and the /etc/hosts lines.
DIR=${AXONHPC_NETNS_DIR:-/tmp/axonhpc-netns}
for ns in $(awk '{print $1}' "$DIR/hosts.map" 2>/dev/null) axsw; do
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  ip netns del "$ns" 2>/dev/null
done
sed -i '/# axonhpc-netns$/d' /etc/hosts
rm -f "$DIR/hosts.map" "$DIR/hostfile"
echo "[netns-down] done"
