// Fake <cuda_runtime.h> for the emulator: everything lives in the force-included emu.h.
#pragma once
#include "emu.h"
