# Sourced by the benchmarks/gpu_issue*.sh scripts on the device: what the device image lacks, and what it has.
# Liger-Kernel is not in the image: it travels as a wheel (pure Python). Put liger_kernel-0.8.5-py3-none-any.whl in
# .whl/ (`.venv/bin/pip download liger-kernel==0.8.5 --no-deps -d .whl`) and name .whl in the device call's `carry`.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__)"
if ls .whl/liger_kernel-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/liger_kernel-*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
