// The QSGD CPU loops built for the "generic" instruction set (flags set in CMakeLists.txt).
#define QCOMM_ISA generic
#include "qsgd_cpu_loops.h"
#include "summable_cpu_loops.h"  // the summable codec's loops, same ISA
