/* shim stand-in for <linux/list.h>: see ../shim.h */
#include "../shim.h"
