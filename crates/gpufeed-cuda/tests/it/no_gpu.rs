//! Without a GPU every entry point returns an error (never panics); with one, the facts hold.

use gpufeed_cuda::{Error, Gpu};

#[test]
fn entry_points_without_a_driver_return_errors() {
    match gpufeed_pinned::driver_available() {
        Err(_) => {
            for err in [
                Gpu::count().unwrap_err(),
                Gpu::list().unwrap_err(),
                Gpu::open(0).unwrap_err(),
            ] {
                assert!(matches!(err, Error::NoCudaDriver), "{err:?}");
                assert!(err.is_no_gpu());
                assert!(err.to_string().contains("NVIDIA driver"), "{err}");
            }
        }
        Ok(()) => eprintln!("a CUDA driver is present: the no-driver path is not exercised here"),
    }
}

#[test]
fn gpu_facts_and_an_invalid_ordinal() {
    let Some(gpu) = crate::gpu_or_skip("gpu_facts_and_an_invalid_ordinal") else {
        return;
    };
    let list = Gpu::list().expect("list");
    assert!(!list.is_empty());
    let info = gpu.info();
    eprintln!("{info:?}");
    assert_eq!(info, &list[0]);
    assert!(info.memory_bytes > 1 << 30);
    assert!(
        info.pci_bus_id.parse::<gpufeed_numa::PciAddress>().is_ok(),
        "{}",
        info.pci_bus_id
    );
    let err = Gpu::open(list.len()).unwrap_err();
    assert!(
        matches!(err, Error::NoDevice { ordinal, count } if ordinal == list.len() && count == list.len()),
        "{err:?}"
    );
    assert!(err.to_string().contains("CUDA_VISIBLE_DEVICES"));
}

#[test]
fn out_of_device_memory_is_an_error() {
    let Some(gpu) = crate::gpu_or_skip("out_of_device_memory_is_an_error") else {
        return;
    };
    let too_much = (gpu.info().memory_bytes * 2) as usize;
    let err = gpu.alloc_zeroed(too_much).unwrap_err();
    assert!(
        err.cu_result() == Some(gpufeed_cuda::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        "{err:?}"
    );
    assert!(err.to_string().contains("free device memory"));
    // The device still works afterwards.
    let small = gpu.alloc_zeroed(4096).expect("alloc after OOM");
    assert_eq!(gpu.to_vec(&small).expect("copy back"), vec![0u8; 4096]);
}
