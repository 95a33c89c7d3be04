/* shim stand-in for <linux/kernel.h>: see ../shim.h */
#include "../shim.h"
