//! On a GPU, against a real S3 server (SeaweedFS): objects load byte-exact into GPU memory,
//! whole and in unaligned ranges, and an object replaced after it was opened is refused.

use gpufeed_load::object::{Credentials, Object, ObjectOptions};
use gpufeed_load::{Error, LoadOptions, Loader};
use gpufeed_testkit::s3::{self, ACCESS_KEY, BUCKET, SECRET_KEY};
use xxhash_rust::xxh3::xxh3_64;

use crate::{gpu_or_skip, random_bytes};

#[test]
fn objects_load_into_gpu_memory_byte_exact() {
    let test = "objects_load_into_gpu_memory_byte_exact";
    let Some(gpu) = gpu_or_skip(test) else { return };
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    let data = random_bytes((40 << 20) + 4321, seed);
    server.put("gpu/data.bin", &data).expect("put");
    let opts = ObjectOptions::default()
        .with_endpoint(&server.endpoint)
        .with_region("us-east-1")
        .with_credentials(Credentials::new(ACCESS_KEY, SECRET_KEY))
        .with_request_bytes((3 << 20) + 5);
    let url = format!("s3://{BUCKET}/gpu/data.bin");
    let object = Object::open(&url, &opts).expect("open");
    let loader = Loader::new(&gpu, LoadOptions::default()).expect("loader");
    let (buf, report) = loader.load_object(&object).expect("load");
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(&data));
    assert_eq!(
        (report.bytes, report.path.to_str()),
        (data.len() as u64, Some(url.as_str()))
    );
    let range = 1_234_567..(33 << 20) + 1;
    let (buf, _) = loader
        .load_object_range(&object, range.clone())
        .expect("range");
    let want = &data[range.start as usize..range.end as usize];
    assert_eq!(xxh3_64(&gpu.to_vec(&buf).expect("back")), xxh3_64(want));
    // Into a buffer of the caller's, at an offset.
    let mut dst = gpu.alloc_zeroed(want.len() + 100).expect("alloc");
    loader
        .load_object_into(&object, range.clone(), &mut dst, 99)
        .expect("into");
    let back = gpu.to_vec(&dst).expect("back");
    assert_eq!(xxh3_64(&back[99..99 + want.len()]), xxh3_64(want));
    assert!(
        back[..99]
            .iter()
            .chain(&back[99 + want.len()..])
            .all(|&b| b == 0)
    );
    // Replaced after open: refused, nothing handed out.
    server
        .put("gpu/data.bin", &random_bytes(data.len(), seed ^ 3))
        .expect("put v2");
    match loader.load_object(&object) {
        Err(Error::Object(gpufeed_load::object::ObjectError::ObjectChanged { .. })) => {}
        other => panic!("a replaced object loaded: {:?}", other.map(|(_, r)| r)),
    }
    let past = loader.load_object_range(&object, 0..object.len() + 1);
    assert!(
        matches!(past, Err(Error::Object(_))),
        "{:?}",
        past.map(|(_, r)| r)
    );
}
