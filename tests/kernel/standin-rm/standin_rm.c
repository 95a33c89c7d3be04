// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * Stand-in nvidia.ko: the RM interface nvidia-uvm imports, for running UVM's own built-in tests
 * (UVM_TEST_PAGE_TREE on fake GPUs) in a VM without a GPU. Part of spark-memsaver's tests, never
 * shipped. Built in an NVIDIA kernel-open tree (tests/support/uvmvm.py), so every prototype is
 * NVIDIA's own (nv_uvm_interface.h): the session and callback registration calls succeed here,
 * every other entry point comes from gen_stubs.py and returns NV_ERR_NOT_SUPPORTED.
 */
#include "standin_rm.h"

#include "standin_api.h"   /* written by gen_stubs.py from this tree's header: STANDIN_RM_EVENTS_API */

static int standin_session;   /* its address is the session handle */

#if STANDIN_RM_EVENTS_API
/* 590 and later: nvUvmInterfaceRegisterUvmEvents / DeRegisterUvmEvents (struct UvmEventsLinux) */
static struct UvmEventsLinux *standin_uvm_events;

NV_STATUS nvUvmInterfaceRegisterUvmEvents(struct UvmEventsLinux *importedEvents)
{
    STANDIN_RM_CALLED("nvUvmInterfaceRegisterUvmEvents", "NV_OK");
    if (importedEvents == NULL)
        return NV_ERR_INVALID_ARGUMENT;
    if (standin_uvm_events != NULL)
        return NV_ERR_IN_USE;
    standin_uvm_events = importedEvents;
    return NV_OK;
}
EXPORT_SYMBOL(nvUvmInterfaceRegisterUvmEvents);

void nvUvmInterfaceDeRegisterUvmEvents(void)
{
    STANDIN_RM_CALLED("nvUvmInterfaceDeRegisterUvmEvents", "void");
    standin_uvm_events = NULL;
}
EXPORT_SYMBOL(nvUvmInterfaceDeRegisterUvmEvents);
#else
/* up to 580: nvUvmInterfaceRegisterUvmCallbacks / DeRegisterUvmOps (struct UvmOpsUvmEvents) */
static struct UvmOpsUvmEvents *standin_uvm_ops;

NV_STATUS nvUvmInterfaceRegisterUvmCallbacks(struct UvmOpsUvmEvents *importedUvmOps)
{
    STANDIN_RM_CALLED("nvUvmInterfaceRegisterUvmCallbacks", "NV_OK");
    if (importedUvmOps == NULL)
        return NV_ERR_INVALID_ARGUMENT;
    if (standin_uvm_ops != NULL)
        return NV_ERR_IN_USE;
    standin_uvm_ops = importedUvmOps;
    return NV_OK;
}
EXPORT_SYMBOL(nvUvmInterfaceRegisterUvmCallbacks);

void nvUvmInterfaceDeRegisterUvmOps(void)
{
    STANDIN_RM_CALLED("nvUvmInterfaceDeRegisterUvmOps", "void");
    standin_uvm_ops = NULL;
}
EXPORT_SYMBOL(nvUvmInterfaceDeRegisterUvmOps);

#endif

NV_STATUS nvUvmInterfaceSessionCreate(uvmGpuSessionHandle *session, UvmPlatformInfo *platformInfo)
{
    STANDIN_RM_CALLED("nvUvmInterfaceSessionCreate", "NV_OK");
    if (session == NULL || platformInfo == NULL)
        return NV_ERR_INVALID_ARGUMENT;
    memset(platformInfo, 0, sizeof(*platformInfo));   /* no ATS, no confidential computing */
    *session = (uvmGpuSessionHandle)&standin_session;
    return NV_OK;
}
EXPORT_SYMBOL(nvUvmInterfaceSessionCreate);

NV_STATUS nvUvmInterfaceSessionDestroy(uvmGpuSessionHandle session)
{
    STANDIN_RM_CALLED("nvUvmInterfaceSessionDestroy", "NV_OK");
    return session == (uvmGpuSessionHandle)&standin_session ? NV_OK : NV_ERR_INVALID_ARGUMENT;
}
EXPORT_SYMBOL(nvUvmInterfaceSessionDestroy);

#if STANDIN_RM_HAS_REPORT_FATAL_ERROR
void nvUvmInterfaceReportFatalError(NV_STATUS error)
{
    pr_err("standin-rm: nvUvmInterfaceReportFatalError(0x%x)\n", error);
}
EXPORT_SYMBOL(nvUvmInterfaceReportFatalError);
#endif

static int __init standin_rm_init(void)
{
    pr_info("standin-rm: stand-in nvidia.ko %s loaded (no GPU, no RM)\n", NV_VERSION_STRING);
    return 0;
}

static void __exit standin_rm_exit(void)
{
#if STANDIN_RM_EVENTS_API
    WARN_ON(standin_uvm_events != NULL);
#else
    WARN_ON(standin_uvm_ops != NULL);
#endif
}

module_init(standin_rm_init);
module_exit(standin_rm_exit);
MODULE_LICENSE("Dual MIT/GPL");
MODULE_INFO(supported, "external");
MODULE_VERSION(NV_VERSION_STRING);
MODULE_DESCRIPTION("spark-memsaver test stand-in for nvidia.ko's RM interface (tests only)");
