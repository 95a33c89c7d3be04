/* shim stand-in for <linux/bug.h>: see ../shim.h */
#include "../shim.h"
