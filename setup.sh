#!/bin/sh
# Installs the Debian packages pdmoe builds with (DESIGN.md) and builds build/pdmoe.
# Run as root, or with sudo available. Safe to run again.
set -eu
PKGS="build-essential pkg-config libjansson-dev libcriterion-dev clang libclang-rt-14-dev libopenmpi-dev openmpi-bin libevent-dev curl libucx-dev libpcre2-dev tidy procps python3 python3-numpy iproute2 libdnnl-dev"
missing=""
for p in $PKGS; do
  # "install ok installed", not just known to dpkg (a removed package keeps its config files)
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
make -j"$(nproc)"
