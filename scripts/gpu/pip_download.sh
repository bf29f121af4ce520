# Sourced by stage.sh and shape.sh: wheels for the GPU machine's Python (3.12, manylinux x86-64), no dependencies.
#   pip_download DIR NAME==VERSION ...
pip_download() {
  local into=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$into" "$@"
}
