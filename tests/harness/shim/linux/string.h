/* shim stand-in for <linux/string.h>: see ../shim.h */
#include "../shim.h"
