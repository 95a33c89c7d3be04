/* shim stand-in for <linux/types.h>: see ../shim.h */
#include "../shim.h"
