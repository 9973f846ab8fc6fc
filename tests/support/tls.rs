//! Certificates for the TLS tests, made fresh in each test: a CA, a server certificate for
//! `localhost` and `127.0.0.1` and a client certificate, all signed by that CA.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use std::path::{Path, PathBuf};

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, as PEM
/// files in `dir`: (ca, server cert, server key, client cert, client key).
pub fn certificates(dir: &Path) -> [PathBuf; 5] {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "kvindex test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server, server_key) = leaf(vec!["127.0.0.1".into(), "localhost".into()]);
    let (client, client_key) = leaf(vec!["kvindex-client".into()]);
    let files = [
        "ca.pem",
        "server.pem",
        "server-key.pem",
        "client.pem",
        "client-key.pem",
    ]
    .map(|name| dir.join(name));
    for (path, pem) in files
        .iter()
        .zip([ca.pem(), server, server_key, client, client_key])
    {
        std::fs::write(path, pem).unwrap();
    }
    files
}
