//! The TLS side of a `tls` probe: a handshake that asks whether the
//! server is up, not who it is. The certificate is not checked against
//! any root (backends' certificates are often internal or self-signed;
//! the balancer does not terminate TLS), but the handshake's signatures
//! are, so a server that cannot complete one fails.

use crate::config::HttpVersion;
use anyhow::{Context, Result};
use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{ring, CryptoProvider},
    pki_types::{CertificateDer, ServerName, UnixTime},
    ClientConfig, DigitallySignedStruct, SignatureScheme,
};
use std::{
    net::SocketAddr,
    sync::{Arc, OnceLock},
};
use tokio::net::TcpStream;
use tokio_rustls::{client::TlsStream, TlsConnector};

/// Accepts any certificate; checks the handshake's signatures.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The client settings for `version` (its ALPN), built once.
fn config(version: HttpVersion) -> Result<Arc<ClientConfig>> {
    static CONFIGS: OnceLock<[Arc<ClientConfig>; 2]> = OnceLock::new();
    if let Some(c) = CONFIGS.get() {
        return Ok(c[version as usize].clone());
    }
    // ring, not aws-lc-rs (which needs cmake to build): it lacks only the
    // post-quantum key exchange, which a health probe does not need.
    #[allow(deprecated)]
    let provider = Arc::new(ring::default_provider());
    let build = |alpn: &[u8]| -> Result<Arc<ClientConfig>> {
        let mut c = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS versions")?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider.clone())))
            .with_no_client_auth();
        c.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(c))
    };
    let both = [build(b"http/1.1")?, build(b"h2")?];
    Ok(CONFIGS.get_or_init(|| both)[version as usize].clone())
}

/// A TLS handshake over `tcp` to `addr`, sending `sni` (none: the
/// address, which sends no server name).
pub async fn handshake(
    tcp: TcpStream,
    addr: SocketAddr,
    sni: Option<&str>,
    version: HttpVersion,
) -> Result<TlsStream<TcpStream>> {
    let name = match sni {
        Some(s) => ServerName::try_from(s.to_string()).context("server name")?,
        None => ServerName::IpAddress(addr.ip().into()),
    };
    let tls = TlsConnector::from(config(version)?)
        .connect(name, tcp)
        .await
        .context("TLS handshake")?;
    if version == HttpVersion::Http2 && tls.get_ref().1.alpn_protocol() != Some(b"h2") {
        anyhow::bail!("TLS handshake: the server did not agree to HTTP/2 (ALPN h2)");
    }
    Ok(tls)
}
