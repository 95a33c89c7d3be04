// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * Stand-ins for nvidia.ko and nvidia-uvm.ko in the guard VM test (tests/test_kernel_guard.py). They stand
 * in ONLY for what modprobe, modinfo and the guard read: the module name, the .modinfo `version`, and for
 * "ours" the `spark_memsaver` tag and a `uvm_pt_pack` parameter. They drive no hardware. Built three
 * times with -DSTANDIN_NAME / -DSTANDIN_VERSION / -DSTANDIN_OURS.
 */
#include <linux/module.h>
#include <linux/init.h>

static int uvm_pt_pack = 3;
#ifdef STANDIN_OURS
module_param(uvm_pt_pack, int, 0444);
MODULE_INFO(spark_memsaver, "uvm-pt-pack/1");
#endif
static char *variant = STANDIN_VARIANT;
module_param(variant, charp, 0444);
MODULE_PARM_DESC(variant, "which stand-in this is (read back by the test through sysfs)");

static int __init standin_init(void)
{
	pr_info("standin %s: %s version %s loaded (tier param %d)\n", KBUILD_MODNAME, variant, STANDIN_VERSION,
		uvm_pt_pack);
	return 0;
}

static void __exit standin_exit(void)
{
}

module_init(standin_init);
module_exit(standin_exit);
MODULE_VERSION(STANDIN_VERSION);
MODULE_LICENSE("Dual MIT/GPL");
MODULE_DESCRIPTION("spark-memsaver test stand-in (no hardware)");
