/* shim stand-in for <linux/mm.h>: see ../shim.h */
#include "../shim.h"
