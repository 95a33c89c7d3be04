/* shim stand-in for <linux/moduleparam.h>: see ../shim.h */
#include "../shim.h"
