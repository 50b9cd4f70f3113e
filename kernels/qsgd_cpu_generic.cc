// The QSGD CPU loops built for the "generic" instruction set (flags set in CMakeLists.txt).
#define QCOMM_ISA generic
#include "qsgd_cpu_loops.h"
