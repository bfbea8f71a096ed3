#!/bin/bash
# Issue #46 on the GPU kit's host (../shared/gpu-sglang: after device_setup.sh and `device_servops.sh sshd`),
# from the project's checkout there (/tmp/src/servops). One call, steps in order (any subset):
#   bash bench/gpu_piecewise_8b.sh model fix phases downtime short long table
#   model     the Llama-3.1-8B-shaped block-FP8 checkpoint, made here (servops/lab/modelgen.py; <2 min)
#   fix       invoke audit --fix on llama8b-pw: on 0.5.17 its default prefill sizes (32 tokens and up) meet
#             sglang's kernel loader inside the compiled region; the audit writes, proves and stores the
#             custom-op patch that the -pw trials' deploys then take (run it before downtime/short/long)
#   phases    deploy llama8b (its first start: cold JIT/compile caches), restart twice, status, history:
#             the start-up split into weights / JIT / compile / capture / other (issue #46.3)
#   pw        #45.6 in one short call: llama8b deployed, then llama8b-pw beside it (its audit stage meets
#             the kernel-loader break and takes the stored proven patch), benched, rolled back, benched
#   downtime  bench/jit_downtime.py: a deploy of llama8b-pw (piecewise: new compile kernels, pre-built
#             beside the serving server) against a plain restart of it (issue #46.4; goal <= 1.3), on
#             caches of its own (/tmp/servops-jit-dt, empty at first): its first deploy of llama8b is a
#             cold first start (every JIT build), whatever the audit or a campaign built before;
#             the steps after it use those caches, warm by then
#   short     tune piecewise-8b-short (128-token prompts): llama8b / -cg / -pw / -breakable, repeated on
#   long      fresh starts until the intervals are known; `long`: 2048-token prompts
#   kitdowntime  downtime on the kit's tiny model (tiny -> tiny-pw; needs device_servops.sh's playbooks)
#   longpw    after downtime: llama8b-pw and llama8b benched at 2048-token prompts (1/8/32, twice each)
#   table     bench/piecewise_value.py: the Markdown table of items 2 and 5 ($OUT/piecewise-8b.md)
# QUICK=1 runs the campaigns lean, for a 30-minute GPU session: each level sends max(2 x level, 16)
# requests of 64 output tokens, twice on one start (the interval), no fresh-start repeats; the long
# campaign only no graphs against piecewise, at 1, 8 and 32.
# Output in $OUT (default /tmp/out): servops-8b.log (every command, rc, seconds), piecewise-8b.md, results-8b.tgz.
set -uo pipefail
export PATH=/tmp/sshroot/bin:/usr/local/cuda/bin:$PATH NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$(cd "$(dirname "$0")/.." && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
PY=${PY:-/tmp/sgvenv/bin/python}; MODEL=${MODEL:-/tmp/models/llama3-8b-fp8}; H=${HOST_NAME:-h200}
KIT=${KIT:-/tmp/payload/kit}
cd "$S"
# the kit's inventory with the 8B model, the JIT/compile caches under /tmp/servops-jit and room for a
# warm-up server beside the serving one (the serving launch holds 0.45 of the card)
$PY - "$KIT/gpu-inventory.yml" "$MODEL" <<'PYEOF'
import sys, yaml
inv = yaml.safe_load(open(sys.argv[1]))
gpu = inv["all"]["children"]["gpu"]["vars"]
gpu.update(model_path=sys.argv[2], jit_cache_dir="/tmp/servops-jit", health_timeout=1800,
           jit_warmup_args={"mem-fraction-static": 0.35})
open("inventory/gpu-8b.yml", "w").write(yaml.safe_dump(inv, sort_keys=False))
gpu["jit_cache_dir"] = "/tmp/servops-jit-dt"
open("inventory/gpu-8b-dt.yml", "w").write(yaml.safe_dump(inv, sort_keys=False))
# the kit's own tiny model (the goal's "first start ~200 s against 25-30 s for a restart"), caches apart
gpu.update(model_path="/tmp/models/tiny-llama", jit_cache_dir="/tmp/servops-jit-kit"); gpu.pop("jit_warmup_args")
open("inventory/gpu-kit-dt.yml", "w").write(yaml.safe_dump(inv, sort_keys=False))
PYEOF
export SERVOPS_INVENTORY=inventory/gpu-8b.yml
run() { echo "### $*" | tee -a "$O/servops-8b.log"; local t0=$(date +%s.%N); timeout 3000 "$@" >>"$O/servops-8b.log" 2>&1; local rc=$?;
        echo "### rc=$rc in $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" | tee -a "$O/servops-8b.log"; tail -6 "$O/servops-8b.log"; }
if [ "${QUICK:-0}" = 1 ]; then  # shorter copies of the two campaigns, under the same names
  mkdir -p "$O/campaigns"
  for c in piecewise-8b-short piecewise-8b-long; do
    sed -e 's/requests: 256/requests: 0/' -e 's/output_len: 128/output_len: 64/' -e 's/max_repeats: 4/max_repeats: 1/' \
        "campaigns/$c.yml" > "$O/campaigns/$c.yml"
  done
  # at long prompts only what decides the question: no graphs against piecewise, levels 1-32
  sed -i -e '/variant: llama8b-cg$/d' -e '/variant: llama8b-breakable$/d' -e 's/levels: \[1, 8, 32, 128\]/levels: [1, 8, 32]/' \
      "$O/campaigns/piecewise-8b-long.yml"
  export SERVOPS_CAMPAIGNS="$O/campaigns"
fi
for step in "$@"; do case $step in
  model) run $PY -m servops.lab.modelgen "$MODEL" --shape llama3-8b --dtype fp8;;
  fix) run $PY -m invoke audit --fix --variant llama8b-pw -H $H;;
  phases) run $PY -m invoke deploy --variant llama8b -H $H; run $PY -m invoke restart -H $H; run $PY -m invoke restart -H $H
          run $PY -m invoke status -H $H; run $PY -m invoke history -H $H; run $PY -m invoke check --variant llama8b-pw -H $H;;
  pw) B=(bench --levels 1,8,32,128 --input-len 128 --output-len 64 -H $H)
      run $PY -m invoke deploy --variant llama8b -H $H; run $PY -m invoke deploy --variant llama8b-pw -H $H
      run $PY -m invoke "${B[@]}"; run $PY -m invoke rollback -H $H; run $PY -m invoke "${B[@]}";;
  downtime) mkdir -p -m 700 /tmp/servops-jit-dt
            # llama8b-pw with the patch its audit stage takes on 0.5.17 (the stored proven one), deployed
            # with --skip-audit: the audit runs before the old server stops, so the downtime is the same
            # and the ~70 s of device time go to the measurement (a variant of this host only)
            printf 'extends: llama8b-pw\npatches: [audit-per-token-group-quant-0.5.17]\n' > playbooks/llama8b-pw-audited.yml
            run $PY bench/jit_downtime.py -I inventory/gpu-8b-dt.yml -H $H --base llama8b --new llama8b-pw-audited --skip-audit
            SERVOPS_INVENTORY=inventory/gpu-8b-dt.yml run $PY -m invoke history -H $H
            # its caches now hold every kernel of both launches: the steps after it start warm, as a
            # serving host's would, and the -pw audit verdicts it kept (same deploy root) stand
            export SERVOPS_INVENTORY=inventory/gpu-8b-dt.yml;;
  kitdowntime) # the same measurement on the kit's tiny bf16 model (device_servops.sh writes tiny and
          # tiny-pw): the issue's goal is stated on it; ~6 min on a fresh machine where the 8B takes ~11
          mkdir -p -m 700 /tmp/servops-jit-kit
          run $PY bench/jit_downtime.py -I inventory/gpu-kit-dt.yml -H $H --base tiny --new tiny-pw --skip-audit
          SERVOPS_INVENTORY=inventory/gpu-kit-dt.yml run $PY -m invoke history -H $H;;
  longpw) # the long-prompt question in one short call, after `downtime` (its -pw release serving, its
          # llama8b base one rollback away, both on warm caches): 2048-token prompts at 1, 8 and 32, each
          # release benched twice on its start; no campaign, so no audit, no fresh-start repeats
          B=(bench --levels 1,8,32 --input-len 2048 --output-len 64 --repeat 2 -H $H)
          run $PY -m invoke "${B[@]}"; run $PY -m invoke rollback -H $H; run $PY -m invoke "${B[@]}"
          run $PY -m invoke compare llama8b llama8b-pw-audited -H $H
          base=$(basename "$(ls -d results/$H/*-llama8b | tail -1)"); pw=$(basename "$(ls -d results/$H/*-llama8b-pw-audited | tail -1)")
          $PY bench/piecewise_value.py -H $H --releases "$base,$pw" > "$O/piecewise-8b-long.md" 2>&1;;
  short) run $PY -m invoke tune piecewise-8b-short -H $H;;
  long) run $PY -m invoke tune piecewise-8b-long -H $H;;
  table) run $PY bench/piecewise_value.py -H $H piecewise-8b-short piecewise-8b-long
         sed -n '/^## What piecewise/,/^### rc=/p' "$O/servops-8b.log" | grep -v '^### rc=' > "$O/piecewise-8b.md";;
esac; done
$PY -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__, torch.cuda.get_device_name(0))" >>"$O/servops-8b.log" 2>&1
tar -czf "$O/results-8b.tgz" results 2>/dev/null; true
