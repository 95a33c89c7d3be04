/* shim stand-in for <linux/xarray.h>: see ../shim.h */
#include "../shim.h"
