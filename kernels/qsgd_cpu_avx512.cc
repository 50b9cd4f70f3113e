// The QSGD CPU loops built for the "avx512" instruction set (flags set in CMakeLists.txt).
#define QCOMM_ISA avx512
#include "qsgd_cpu_loops.h"
#include "summable_cpu_loops.h"  // the summable codec's loops, same ISA
