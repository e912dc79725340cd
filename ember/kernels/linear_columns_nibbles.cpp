// The linear kernel's columns for 4-bit weights: Q4, Q4S and Q4K (linear_column_range.h).
#include "linear_column_range.h"

EMBER_LINEAR_COLUMNS(Q4)
EMBER_LINEAR_COLUMNS(Q4S)
EMBER_LINEAR_COLUMNS(Q4K)
