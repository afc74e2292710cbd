#!/usr/bin/env bash
# libaio without root and without internet, for DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload).
#
#   baselines/libaio.sh fetch .libaio     # here (apt and internet): download the runtime and dev .debs
#   eval "$(baselines/libaio.sh env .libaio)"   # on the GPU machine, before python starts
#
# `env` unpacks the .debs under a prefix in /tmp (LIBAIO_PREFIX, default /tmp/libaio), never into /,
# and prints the exports that make DeepSpeed find libaio at each of its three stages:
#   compatibility check  AsyncIOBuilder.is_compatible() compiles and links a test program calling
#                        io_submit, adding $CFLAGS and $LDFLAGS (and gcc honours CPATH, LIBRARY_PATH);
#   JIT build            torch.utils.cpp_extension passes neither CFLAGS nor LDFLAGS to ninja:
#                        g++ finds libaio.h through CPATH and -laio through LIBRARY_PATH;
#   load                 the built op has no rpath: the loader finds libaio.so.1 through LD_LIBRARY_PATH,
#                        which is read when a process starts, hence the exports come before python.
set -euo pipefail

usage() { echo "usage: $0 fetch DIR | env DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
mode=$1; dir=$2

fetch() {
  mkdir -p "$dir"; cd "$dir"
  # libaio1 (Debian 12, Ubuntu 22.04) needs only glibc 2.4, so it loads on any distro the GPU image
  # may have; newer releases renamed it libaio1t64 (same code, soname libaio.so.1t64).
  local runtime=libaio1
  apt-cache show libaio1 >/dev/null 2>&1 || runtime=libaio1t64
  apt-get download "$runtime" libaio-dev
  ls -l "$PWD"/*.deb
}

unpack() {  # DEB PREFIX: dpkg -x where dpkg exists, else the .deb's ar members by hand
  if command -v dpkg >/dev/null; then
    dpkg -x "$1" "$2"
  else
    local tmp; tmp=$(mktemp -d)
    (cd "$tmp" && ar x "$1")
    tar -xf "$tmp"/data.tar.* -C "$2"
    rm -rf "$tmp"
  fi
}

env_exports() {
  local debs=("$dir"/*.deb)
  [ -e "${debs[0]}" ] || { echo "libaio.sh: no .deb in $dir (run '$0 fetch $dir' on a machine with apt)" >&2; exit 1; }
  local prefix=${LIBAIO_PREFIX:-/tmp/libaio}
  rm -rf "$prefix"; mkdir -p "$prefix"
  local deb
  for deb in "${debs[@]}"; do unpack "$(cd "$(dirname "$deb")" && pwd)/$(basename "$deb")" "$prefix"; done
  # Older libaio-dev packages link libaio.so to an absolute /lib/... path: re-point such links into the prefix.
  local link target
  while IFS= read -r link; do
    target=$(readlink "$link")
    case "$target" in /*) ln -sfn "$prefix$target" "$link" ;; esac
  done < <(find "$prefix" -type l -name 'libaio.so*')
  local header lib libdirs
  header=$(find "$prefix" -name libaio.h | head -n 1)
  lib=$(find "$prefix" -name libaio.so | head -n 1)
  [ -n "$header" ] && [ -n "$lib" ] && [ -e "$lib" ] \
    || { echo "libaio.sh: libaio.h or a working libaio.so missing under $prefix (are both libaio1 and libaio-dev in $dir?)" >&2; exit 1; }
  # The runtime library may sit in another directory than the dev link (/lib vs /usr/lib).
  libdirs=$(find "$prefix" -name 'libaio.so*' -exec dirname {} \; | sort -u | paste -sd:)
  local inc=${header%/*} ldflags="" d
  for d in ${libdirs//:/ }; do ldflags="$ldflags -L$d"; done
  printf 'export CFLAGS=%q\n' "-I$inc${CFLAGS:+ $CFLAGS}"
  printf 'export LDFLAGS=%q\n' "${ldflags# }${LDFLAGS:+ $LDFLAGS}"
  printf 'export CPATH=%q\n' "$inc${CPATH:+:$CPATH}"
  printf 'export LIBRARY_PATH=%q\n' "$libdirs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  printf 'export LD_LIBRARY_PATH=%q\n' "$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

case "$mode" in
  fetch) fetch ;;
  env) env_exports ;;
  *) usage ;;
esac
