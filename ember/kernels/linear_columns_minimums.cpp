// The linear kernel's columns for 8-bit weights with a minimum, and their five- and six-bit
// layouts: Q8M, Q6M and Q5K (linear_column_range.h).
#include "linear_column_range.h"

EMBER_LINEAR_COLUMNS(Q8M)
EMBER_LINEAR_COLUMNS(Q6M)
EMBER_LINEAR_COLUMNS(Q5K)
