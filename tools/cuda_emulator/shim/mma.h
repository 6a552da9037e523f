// Fake <mma.h>: the emulator compiles only code outside __CUDA_ARCH__ branches, so WMMA is never used.
#pragma once
#include "emu.h"
