/* shim stand-in for <linux/module.h>: see ../shim.h */
#include "../shim.h"
