// Baseline-ISA variant of the division check (division_isa.h).
#define AMPFUSED_TESTING_FN division_mismatches_base
#include "division_isa.h"
