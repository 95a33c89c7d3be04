/* shim stand-in for <linux/overflow.h>: see ../shim.h */
#include "../shim.h"
