# Sourced by build.sh, fuzz.sh and sanitize.sh (with $root set to the repository root): where
# ccache is installed (setup.sh installs it), every compile of a new build tree goes through it.
# CI runs on the machine of the session that submitted, in a fresh clone in another folder, so
# the cache makes its builds mostly hits on what that session compiled. For hits across clones:
# paths under the root are hashed relative to it (base_dir) and the build folder is left out
# of the hash of -g compiles (hash_dir; their debug info then names the first clone's folder).
# Sets `compiler_launcher`: the cmake -D options for a new build tree (empty without ccache).
compiler_launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=$root
  export CCACHE_NOHASHDIR=true
  compiler_launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
    -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
