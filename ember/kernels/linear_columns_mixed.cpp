// The linear kernel's columns for 8-bit weights with steps for each half and a minimum (a fused
// projection's parts of both families), and their six-bit layout: Q8SM and Q6SM
// (linear_column_range.h).
#include "linear_column_range.h"

EMBER_LINEAR_COLUMNS(Q8SM)
EMBER_LINEAR_COLUMNS(Q6SM)
