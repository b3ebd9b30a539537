#pragma once
// torchmoe: Mixture-of-Experts training layers for LibTorch. The one header a trainer includes.

#include "torchmoe/checkpoint/hf_moe.h"
#include "torchmoe/checkpoint/safetensors.h"
#include "torchmoe/distributed/collectives.h"
#include "torchmoe/distributed/process_group.h"
#include "torchmoe/fp8/autocast.h"
#include "torchmoe/fp8/state.h"
#include "torchmoe/modules/glu.h"
#include "torchmoe/modules/grouped_linear.h"
#include "torchmoe/modules/grouped_mlp.h"
#include "torchmoe/modules/moe_layer.h"
#include "torchmoe/modules/router.h"
#include "torchmoe/modules/token_permutation.h"
#include "torchmoe/optim/fused_adamw.h"
