// The linear kernel's columns for 8-bit weights of a step for each half block, and their six-bit
// layouts: Q8S, Q6S and Q6K (linear_column_range.h).
#include "linear_column_range.h"

EMBER_LINEAR_COLUMNS(Q8S)
EMBER_LINEAR_COLUMNS(Q6S)
EMBER_LINEAR_COLUMNS(Q6K)
