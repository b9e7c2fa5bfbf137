#!/bin/sh
# Copies the shared libraries that ELF files need into DEST, leaving out those the runtime image
# already has: glibc, libstdc++ and libgcc_s (every Ubuntu/Debian base has newer or equal ones)
# and the CUDA libraries (the nvidia/cuda runtime image ships them; the driver's libcuda comes
# from the NVIDIA container toolkit at run time). Used by gpu-worker.Dockerfile.
#   collect-runtime-libs.sh DEST ELF...
# Exits 1, naming the library, when one that is not left out cannot be resolved here.
set -eu

if [ "$#" -lt 2 ]; then
  echo "usage: $0 DEST ELF..." >&2
  exit 2
fi
dest=$1
shift
mkdir -p "$dest"

# Sonames the runtime image provides: glibc's, the GCC runtime's, CUDA's and the driver's.
glibc='ld-linux[^ ]*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libmvec'
gcc='libstdc\+\+|libgcc_s'
cuda='libcuda|libcudart|libcublas|libcublasLt|libnvrtc|libnvJitLink|libcufft|libcurand'
cuda="$cuda|libcusparse|libcusolver|libnccl|libnvidia-[^ ]*"
provided="^($glibc|$gcc|$cuda)\.so"

status=0
for elf in "$@"; do
  # ldd lines: "libfoo.so.1 => /path/libfoo.so.1 (0x...)" or "libfoo.so.1 => not found".
  ldd "$elf" | awk '$2 == "=>" { print $1, $3 }' > /tmp/collect-libs.$$
  while read -r soname path; do
    if echo "$soname" | grep -Eq "$provided"; then
      continue
    fi
    if [ "$path" = "not" ]; then
      echo "collect-runtime-libs: $elf needs $soname, which is not installed" >&2
      status=1
      continue
    fi
    cp -L "$path" "$dest/$soname"
  done < /tmp/collect-libs.$$
  rm -f /tmp/collect-libs.$$
done
exit "$status"
