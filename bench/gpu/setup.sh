# Source this on the GPU machine from the root of a copy of the checkout (bash), where holoserve is not installed:
# installs the bundled wheels (.whl/, .whl-train/, .whl-cslt/) into /tmp/site, links compress/ and export/ into holoserve/
# (they are holoserve.compress and holoserve.export, as pyproject.toml maps them), and puts
# /tmp/site and the repository root on PYTHONPATH.
#   source bench/gpu/setup.sh || exit
for wheels in .whl .whl-train .whl-cslt; do  # serving/benchmark, training, nvmath-python: whichever were copied
    if compgen -G "$wheels/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheels"/*.whl || return 1
    fi
done
ln -sfn ../compress holoserve/compress && ln -sfn ../export holoserve/export || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
(cd / && python3 -c "import holoserve.compress, holoserve.export") || return 1
