#!/usr/bin/env bash
# Starts Kiln on the NPUs the pod was given. Environment (with defaults):
#   MODEL_PATH=/model  KILN_PORT=8080  KILN_TP=1  KILN_CONFIG=/kiln/kiln.yaml
#   KILN_EAGER=0 (1: no graph mode)  and the Ascend switches below.
set -euo pipefail

# CANN: the toolkit, and ATB for the _npu_* ops.
source /usr/local/Ascend/ascend-toolkit/set_env.sh
if [ -f /usr/local/Ascend/nnal/atb/set_env.sh ]; then source /usr/local/Ascend/nnal/atb/set_env.sh; fi

# The device plugin exposes the pod's NPUs; the runtime numbers them from 0.
export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-0}
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}

# Precision switches (see the Ascend README section); the defaults suit most models.
export USE_PFA_HIGH_PRECISION_MODE=${USE_PFA_HIGH_PRECISION_MODE:-1}
export USE_IFA_HIGH_PRECISION_MODE=${USE_IFA_HIGH_PRECISION_MODE:-0}
# Decode gears for graph mode (1 is never a gear; max-num-seqs is always the largest).
export PTA_TORCHAIR_DECODE_GEAR_LIST=${PTA_TORCHAIR_DECODE_GEAR_LIST:-2,4,8,16,32,64,128}
# Compiled graphs persist on the host mount, so a restart skips compilation.
export TORCHAIR_CACHE_HOME=${TORCHAIR_CACHE_HOME:-/kiln}

args=(serve "${MODEL_PATH:-/model}" --device npu --host 0.0.0.0 --port "${KILN_PORT:-8080}"
      --tensor-parallel-size "${KILN_TP:-1}")
if [ -f "${KILN_CONFIG:-/kiln/kiln.yaml}" ]; then args+=(--config "${KILN_CONFIG:-/kiln/kiln.yaml}"); fi
if [ "${KILN_EAGER:-0}" = "1" ]; then args+=(--enforce-eager); fi
exec kiln "${args[@]}"
