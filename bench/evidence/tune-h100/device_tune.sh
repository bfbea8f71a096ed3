#!/bin/bash
# Issue 40 on the real sglang 0.5.17 (H100/H200): a sequential campaign (repeats until the verdict is sure,
# the end re-bench, start-up as a constraint), then issue 36's leftovers: patch.preflight on the GPU, the fix set
# resolved by a `when:` rule on a block-FP8 model, and the rollback verb. After device_setup.sh.
# Steps: setup tune seed
set -uo pipefail
export CUDA_HOME=/usr/local/cuda PATH=/tmp/sshroot/bin:/usr/local/cuda/bin:/tmp/sgvenv/bin:/opt/torch/.venv/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
K=/tmp/payload/kit; O=${OUT:-/tmp/out}; mkdir -p "$O"; PY=/tmp/sgvenv/bin/python; S=/tmp/src/servops
L="$O/tune.log"
run() { echo "### $*" | tee -a "$L"; local t0=$(date +%s.%N); timeout ${TMO:-400} $PY -m invoke "$@" >>"$L" 2>&1; local rc=$?; echo "### rc=$rc in $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" | tee -a "$L"; tail -4 "$L" | cut -c1-400; }
grab() { for l in /tmp/servops-deploy/releases/*/server.log; do [ -f "$l" ] && cp "$l" "$O/server-$(basename "$(dirname "$l")").log"; done; }
for step in "$@"; do case $step in
setup)
  OUT=$O bash $K/device_servops.sh sshd >>"$L" 2>&1
  cd "$S"; sed 's#/tmp/models/tiny-llama#/tmp/models/tiny-fp8#' inventory/gpu.yml > inventory/gpu-fp8.yml
  # piecewise on the block-FP8 model as the repo's piecewise playbook resolves it: the fix set comes from a when: rule
  printf '%s\n' 'extends: tiny' 'server_args:' '  fp8-gemm-backend: flashinfer_deepgemm' '  cuda-graph-backend-prefill: tc_piecewise' \
    '  cuda-graph-bs-prefill: [4, 8, 16]' 'patches: [cuda-version-no-subprocess]' 'when:' '  - sglang: ">=0.5.9,<0.5.22"' \
    '    note: the dynamo capture meets the bare FlashInfer FP8 block-scale GEMM' '    patches: [flashinfer-fp8-blockscale-custom-op]' > playbooks/fp8-pw-when.yml
  printf 'extends: tiny\nserver_args:\n  fp8-gemm-backend: flashinfer_deepgemm\n' > playbooks/fp8.yml
  tail -5 "$L";;
tune)
  cd "$S"; export SERVOPS_INVENTORY=inventory/gpu.yml
  printf '%s\n' 'base: tiny' 'candidates:' '  - variant: tiny-cg' '  - name: mrr' '    grid: {server_args: {max-running-requests: [8, 64]}}' \
    'bench: {levels: [32], requests: 64, input_len: 128, output_len: 128}' \
    'objective: {maximize: output_tps@32, constraints: ["failed == 0", "start_s <= 300"], max_repeats: 3, rebench_top: 2, starts_per_day: 24}' \
    'budget: {max_trials: 6}' 'leave: best' > campaigns/gpu-seq.yml
  TMO=560 run tune gpu-seq -H h200
  run tune.report gpu-seq -H h200
  cp -r results/h200/campaigns/gpu-seq "$O/campaign-gpu-seq" 2>/dev/null; ls "$O/campaign-gpu-seq" >>"$L" 2>&1;;
seed)
  cd "$S"; export SERVOPS_INVENTORY=inventory/gpu-fp8.yml
  run patch.preflight --name flashinfer-fp8-blockscale-custom-op -H h200
  run check --variant fp8-pw-when -H h200
  run deploy --variant fp8-pw-when -H h200
  cur=$(readlink /tmp/servops-deploy/current); grep -n "Capture\|capture" /tmp/servops-deploy/$cur/server.log | tail -6 >>"$L" 2>&1
  run bench --levels 1,8 --requests 16 -H h200
  run patch.status -H h200
  run rollback -H h200
  run patch.status -H h200
  run stop -H h200
  run history -H h200
  grab; tar -czf "$O/results.tgz" -C "$S" results 2>/dev/null;;
esac; done; true
