//! Who may call which route: an optional bearer token (`http.auth_token_file` or
//! `KVINDEX_HTTP__AUTH_TOKEN`) checked in constant time, required on mutating routes always and
//! on reads (`/metrics` included) when `http.auth_reads` is set. Without a token, mutating
//! routes are served to loopback peers only. The probes (`/healthz`, `/readyz`) are never
//! guarded: the router does not put them behind [`reads`] or [`mutations`].
//!
//! The decision is the pure [`AuthPolicy::check`] (unit-tested here); [`reads`] and
//! [`mutations`] are the middleware that feed it the `Authorization` header and the peer
//! address (axum's `ConnectInfo<SocketAddr>`; a request without one counts as remote).

use super::error::ApiError;
use crate::config::{HttpConfig, Secret};
use crate::util::LogEvery;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use ring::digest::{SHA256, digest};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// What a route does, for the policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Lookups, listings, stats, metrics.
    Read,
    /// Changes the index (`DELETE /v1/engines/{id}`).
    Mutate,
}

/// Why a request is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// No bearer token in the request, and the route needs one (401).
    #[error("missing bearer token")]
    MissingToken,
    /// A bearer token that is not the configured one (401, `error="invalid_token"`).
    #[error("invalid bearer token")]
    InvalidToken,
    /// A mutating route, no token configured, and the peer is not on loopback (403).
    #[error("no token configured and the peer is not on loopback")]
    LoopbackOnly,
}

impl From<Denied> for ApiError {
    fn from(d: Denied) -> ApiError {
        match d {
            Denied::MissingToken => ApiError::MissingToken,
            Denied::InvalidToken => ApiError::InvalidToken,
            Denied::LoopbackOnly => ApiError::Forbidden(
                "this route changes the index and is served to loopback peers only while no \
                 token is configured; set http.auth_token_file or KVINDEX_HTTP__AUTH_TOKEN"
                    .into(),
            ),
        }
    }
}

/// The token (as its SHA-256 digest: equal-length values compare in constant time, whatever
/// the length presented) and whether reads need it. Cheap to clone; `Debug` shows no token.
#[derive(Clone, Default)]
pub struct AuthPolicy {
    digest: Option<Arc<[u8; 32]>>,
    auth_reads: bool,
}

impl std::fmt::Debug for AuthPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthPolicy")
            .field("token", &self.digest.as_ref().map(|_| "<redacted>"))
            .field("auth_reads", &self.auth_reads)
            .finish()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

impl AuthPolicy {
    /// A policy with `token` (`None`: mutations from loopback only, reads open).
    /// `auth_reads` without a token is ignored: there is nothing to require.
    pub fn new(token: Option<&Secret>, auth_reads: bool) -> AuthPolicy {
        let digest = token
            .filter(|t| !t.is_empty())
            .map(|t| Arc::new(sha256(t.expose().as_bytes())));
        AuthPolicy {
            auth_reads: auth_reads && digest.is_some(),
            digest,
        }
    }

    /// The policy `http` configures (reads the token file, if any).
    pub fn from_config(http: &HttpConfig) -> Result<AuthPolicy, crate::config::ConfigError> {
        Ok(AuthPolicy::new(
            http.bearer_token()?.as_ref(),
            http.auth_reads,
        ))
    }

    pub fn has_token(&self) -> bool {
        self.digest.is_some()
    }

    /// May a request for `access` from `peer` (`None`: unknown, counted as remote) with this
    /// `Authorization` header value go through?
    pub fn check(
        &self,
        access: Access,
        peer: Option<IpAddr>,
        authorization: Option<&[u8]>,
    ) -> Result<(), Denied> {
        let Some(expected) = &self.digest else {
            return match access {
                Access::Read => Ok(()),
                Access::Mutate if peer.is_some_and(|ip| ip.to_canonical().is_loopback()) => Ok(()),
                Access::Mutate => Err(Denied::LoopbackOnly),
            };
        };
        if access == Access::Read && !self.auth_reads {
            return Ok(());
        }
        let presented = authorization.and_then(bearer).ok_or(Denied::MissingToken)?;
        if bool::from(sha256(presented).ct_eq(&expected[..])) {
            Ok(())
        } else {
            Err(Denied::InvalidToken)
        }
    }
}

/// The credentials of an `Authorization: Bearer <token>` value (scheme case-insensitive);
/// `None` for another scheme or no header.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    // "Bearer" alone (or followed by spaces only) presents an empty, hence invalid, token.
    match rest.first() {
        None => Some(&[]),
        Some(b' ') => Some(rest.trim_ascii()),
        Some(_) => None,
    }
}

/// Middleware of the read routes.
pub async fn reads(State(policy): State<AuthPolicy>, req: Request, next: Next) -> Response {
    guard(&policy, Access::Read, req, next).await
}

/// Middleware of the mutating routes.
pub async fn mutations(State(policy): State<AuthPolicy>, req: Request, next: Next) -> Response {
    guard(&policy, Access::Mutate, req, next).await
}

/// One warning per period at most: refused requests are an attacker's to multiply.
static DENIED_LOG: LazyLock<LogEvery> = LazyLock::new(|| LogEvery::new(Duration::from_secs(10)));

async fn guard(policy: &AuthPolicy, access: Access, req: Request, next: Next) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match policy.check(access, peer, authorization) {
        Ok(()) => next.run(req).await,
        Err(denied) => {
            // The header's value is never logged, only why it failed.
            if denied != Denied::MissingToken && DENIED_LOG.ready() {
                tracing::warn!(
                    peer = ?peer,
                    method = %req.method(),
                    path = req.uri().path(),
                    reason = %denied,
                    "request refused"
                );
            }
            ApiError::from(denied).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const LOOPBACK: Option<IpAddr> = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    const REMOTE: Option<IpAddr> = Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7)));

    fn with_token(auth_reads: bool) -> AuthPolicy {
        AuthPolicy::new(Some(&Secret::new("s3cret-token")), auth_reads)
    }

    #[test]
    fn without_a_token_mutations_are_loopback_only() {
        let p = AuthPolicy::new(None, false);
        assert_eq!(p.check(Access::Mutate, LOOPBACK, None), Ok(()));
        let mapped: IpAddr = Ipv4Addr::LOCALHOST.to_ipv6_mapped().into();
        assert_eq!(p.check(Access::Mutate, Some(mapped), None), Ok(()));
        assert_eq!(
            p.check(Access::Mutate, Some(Ipv6Addr::LOCALHOST.into()), None),
            Ok(())
        );
        assert_eq!(
            p.check(Access::Mutate, REMOTE, None),
            Err(Denied::LoopbackOnly)
        );
        assert_eq!(
            p.check(Access::Mutate, None, None),
            Err(Denied::LoopbackOnly)
        );
        // A header is no way around it: there is no token to check it against.
        assert_eq!(
            p.check(Access::Mutate, REMOTE, Some(b"Bearer anything")),
            Err(Denied::LoopbackOnly)
        );
        assert_eq!(p.check(Access::Read, REMOTE, None), Ok(()));
    }

    #[test]
    fn with_a_token_mutations_need_it_from_anywhere() {
        let p = with_token(false);
        for peer in [LOOPBACK, REMOTE, None] {
            assert_eq!(
                p.check(Access::Mutate, peer, None),
                Err(Denied::MissingToken)
            );
            assert_eq!(
                p.check(Access::Mutate, peer, Some(b"Bearer wrong")),
                Err(Denied::InvalidToken)
            );
            assert_eq!(
                p.check(Access::Mutate, peer, Some(b"Bearer s3cret-token")),
                Ok(())
            );
            assert_eq!(p.check(Access::Read, peer, None), Ok(()));
        }
        assert_eq!(
            p.check(Access::Mutate, REMOTE, Some(b"bearer s3cret-token")),
            Ok(())
        );
        // A prefix, an extension, another scheme, an empty token.
        for bad in [
            &b"Bearer s3cret"[..],
            b"Bearer s3cret-token2",
            b"Bearer",
            b"Bearer ",
        ] {
            assert_eq!(
                p.check(Access::Mutate, REMOTE, Some(bad)),
                Err(Denied::InvalidToken),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(
            p.check(Access::Mutate, REMOTE, Some(b"Basic czNjcmV0LXRva2Vu")),
            Err(Denied::MissingToken)
        );
        assert_eq!(
            p.check(Access::Mutate, REMOTE, Some(b"Bearers3cret-token")),
            Err(Denied::MissingToken)
        );
    }

    #[test]
    fn auth_reads_guards_reads_too() {
        let p = with_token(true);
        assert_eq!(
            p.check(Access::Read, LOOPBACK, None),
            Err(Denied::MissingToken)
        );
        assert_eq!(
            p.check(Access::Read, LOOPBACK, Some(b"Bearer nope")),
            Err(Denied::InvalidToken)
        );
        assert_eq!(
            p.check(Access::Read, REMOTE, Some(b"Bearer s3cret-token")),
            Ok(())
        );
        // Without a token there is nothing to require.
        assert_eq!(
            AuthPolicy::new(None, true).check(Access::Read, REMOTE, None),
            Ok(())
        );
    }

    #[test]
    fn debug_shows_no_token() {
        let text = format!("{:?}", with_token(true));
        assert!(!text.contains("s3cret"), "{text}");
        assert!(text.contains("redacted"), "{text}");
    }
}
