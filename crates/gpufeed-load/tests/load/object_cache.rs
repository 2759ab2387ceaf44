//! The local cache of objects against a real S3 server (SeaweedFS), no GPU needed: a version
//! is fetched once and byte-exact, a replaced object gets a file of its own, an object
//! replaced after it was opened leaves nothing under its name, and directories or names that
//! others could plant are refused.

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use gpufeed_load::object::{Credentials, Object, ObjectCache, ObjectOptions};
use gpufeed_testkit::s3::{self, ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedFs};
use xxhash_rust::xxh3::xxh3_64;

use crate::random_bytes;

fn opts(server: &SeaweedFs) -> ObjectOptions {
    ObjectOptions::default()
        .with_endpoint(&server.endpoint)
        .with_region("us-east-1")
        .with_credentials(Credentials::new(ACCESS_KEY, SECRET_KEY))
        .with_request_bytes((5 << 20) + 3)
}

#[test]
fn an_objects_version_is_fetched_once_and_byte_exact() {
    let test = "an_objects_version_is_fetched_once_and_byte_exact";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    // Over two of the fetch's 64 MiB pieces, at an odd size.
    let data = random_bytes((130 << 20) + 77, seed);
    server.put("cache/a.bin", &data).expect("put");
    let url = format!("s3://{BUCKET}/cache/a.bin");
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("made/here");
    let cache = ObjectCache::open(&dir).expect("cache");
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    let object = Object::open(&url, &opts(&server)).expect("open");
    let first = cache.fetch(&object).expect("fetch");
    assert!(first.fetched && first.bytes == data.len() as u64);
    assert!(first.path.starts_with(&dir));
    assert!(
        first
            .path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .ends_with("-a.bin")
    );
    assert_eq!(
        xxh3_64(&std::fs::read(&first.path).unwrap()),
        xxh3_64(&data)
    );
    // Never writable by the group or others, whatever the umask gives a new file.
    assert_eq!(std::fs::metadata(&first.path).unwrap().mode() & 0o022, 0);
    // Again, through a new open of the same version: the file that is there.
    let again = cache
        .fetch(&Object::open(&url, &opts(&server)).expect("open"))
        .expect("again");
    assert!(!again.fetched, "fetched twice");
    assert_eq!(again.path, first.path);
    // Replaced: a new version, a file of its own; the old one stays.
    let other = random_bytes(1001, seed + 1);
    server.put("cache/a.bin", &other).expect("put");
    let new = cache
        .fetch(&Object::open(&url, &opts(&server)).expect("open"))
        .expect("new version");
    assert!(new.fetched && new.path != first.path);
    assert_eq!(std::fs::read(&new.path).unwrap(), other);
    assert_eq!(
        xxh3_64(&std::fs::read(&first.path).unwrap()),
        xxh3_64(&data)
    );
    // An empty object.
    server.put("cache/empty.bin", b"").expect("put");
    let empty = cache
        .fetch(&Object::open(&format!("s3://{BUCKET}/cache/empty.bin"), &opts(&server)).unwrap())
        .expect("empty");
    assert_eq!(std::fs::read(&empty.path).unwrap(), b"");
}

#[test]
fn an_object_replaced_after_its_open_leaves_nothing_cached() {
    let test = "an_object_replaced_after_its_open_leaves_nothing_cached";
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    let seed = gpufeed_testkit::seed(test);
    server
        .put("cache/b.bin", &random_bytes((9 << 20) + 5, seed))
        .expect("put");
    let url = format!("s3://{BUCKET}/cache/b.bin");
    let object = Object::open(&url, &opts(&server)).expect("open");
    server
        .put("cache/b.bin", &random_bytes((9 << 20) + 5, seed + 1))
        .expect("put");
    let root = tempfile::tempdir().expect("tempdir");
    // Whatever the umask made it: a private directory.
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let cache = ObjectCache::open(root.path()).expect("cache");
    let e = cache.fetch(&object).unwrap_err();
    assert!(e.to_string().contains("cache/b.bin"), "{e}");
    assert!(
        !cache.path_of(&object).exists(),
        "a half-fetched file under the name"
    );
    let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().flatten().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn cache_directories_and_names_others_could_plant_are_refused() {
    let test = "cache_directories_and_names_others_could_plant_are_refused";
    let root = tempfile::tempdir().expect("tempdir");
    // Group- or world-writable: refused, and left as it is.
    let open = root.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = ObjectCache::open(&open).unwrap_err();
    assert!(e.to_string().contains("may write in it"), "{e}");
    assert_eq!(std::fs::metadata(&open).unwrap().mode() & 0o7777, 0o777);
    // A link to a directory: refused.
    let real = root.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = root.path().join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let e = ObjectCache::open(&link).unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
    // A file: refused.
    std::fs::write(root.path().join("file"), b"x").unwrap();
    assert!(ObjectCache::open(root.path().join("file")).is_err());
    // Another user's directory (root can make one).
    if gpufeed_testkit::is_root() {
        let theirs = root.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let e = ObjectCache::open(&theirs).unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
    } else {
        gpufeed_testkit::skip(test, &"another user's directory needs root to make");
    }
    // A planted link under the name a version is cached as: refused, the target untouched.
    let Some(server) = s3::seaweedfs_or_skip(test) else {
        return;
    };
    server.put("cache/c.bin", b"the object").expect("put");
    let object = Object::open(&format!("s3://{BUCKET}/cache/c.bin"), &opts(&server)).unwrap();
    let cache = ObjectCache::open(&real).expect("cache");
    let victim = root.path().join("victim");
    std::fs::write(&victim, b"not the object").unwrap();
    std::os::unix::fs::symlink(&victim, cache.path_of(&object)).unwrap();
    let e = cache.fetch(&object).unwrap_err();
    assert!(e.to_string().contains("remove it"), "{e}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"not the object");
    // A file others may write under the name: refused too.
    std::fs::remove_file(cache.path_of(&object)).unwrap();
    std::fs::write(cache.path_of(&object), b"the object").unwrap();
    std::fs::set_permissions(
        cache.path_of(&object),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    let e = cache.fetch(&object).unwrap_err();
    assert!(e.to_string().contains("written by others"), "{e}");
    // A cached file of another size (cut short by hand): fetched again, whole.
    std::fs::remove_file(cache.path_of(&object)).unwrap();
    std::fs::write(cache.path_of(&object), b"the obj").unwrap();
    std::fs::set_permissions(
        cache.path_of(&object),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let got = cache.fetch(&object).expect("fetch");
    assert!(got.fetched);
    assert_eq!(std::fs::read(&got.path).unwrap(), b"the object");
}
