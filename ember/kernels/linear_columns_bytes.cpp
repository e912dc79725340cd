// The linear kernel's columns for 8-bit weights of one step a block, and their six-bit layout: Q8
// and Q6 (linear_column_range.h).
#include "linear_column_range.h"

EMBER_LINEAR_COLUMNS(Q8)
EMBER_LINEAR_COLUMNS(Q6)
