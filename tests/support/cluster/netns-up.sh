#!/usr/bin/env bash
# netns-up.sh N -- N simulated hosts host1..hostN: network namespaces joined by a bridge that lives
# in a namespace of its own ("axsw"), addresses 10.77.0.11.. Writes hosts.map and hostfile into
# $AXONHPC_NETNS_DIR (default /tmp/axonhpc-netns). Nothing is added to the root namespace's network.
set -euo pipefail
N=${1:-2}
DIR=${AXONHPC_NETNS_DIR:-/tmp/axonhpc-netns}
mkdir -p "$DIR"
ip netns add axsw
ip -n axsw link set lo up
ip -n axsw link add br0 type bridge
ip -n axsw link set br0 up
: > "$DIR/hosts.map"; : > "$DIR/hostfile"
for i in $(seq 1 "$N"); do
  host=host$i; addr=10.77.0.$((10 + i))
  ip netns add "$host"
  ip -n "$host" link set lo up
  ip -n "$host" link add eth0 type veth peer name p$i netns axsw
  ip -n "$host" addr add "$addr/24" dev eth0
  ip -n "$host" link set eth0 up
  ip -n axsw link set p$i master br0
  ip -n axsw link set p$i up
  echo "$host $addr" >> "$DIR/hosts.map"
  echo "$host" >> "$DIR/hostfile"
done
grep -q '# axonhpc-netns' /etc/hosts || awk '{print $2" "$1" # axonhpc-netns"}' "$DIR/hosts.map" >> /etc/hosts
echo "[netns-up] $N hosts"
