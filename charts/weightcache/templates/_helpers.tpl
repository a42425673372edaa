{{/*
Names. Every object is `<fullname>-<role>`; fullname is the release name unless
fullnameOverride says otherwise, so the webhook Service of release R is `R-webhook`.
*/}}
{{- define "weightcache.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "weightcache.operatorName" -}}
{{- printf "%s-operator" (include "weightcache.fullname" .) -}}
{{- end -}}

{{- define "weightcache.webhookService" -}}
{{- printf "%s-webhook" (include "weightcache.fullname" .) -}}
{{- end -}}

{{- define "weightcache.tlsSecret" -}}
{{- printf "%s-webhook-tls" (include "weightcache.fullname" .) -}}
{{- end -}}

{{/* The namespace of every cache's daemons: the admin's, never a tenant's. */}}
{{- define "weightcache.daemonNamespace" -}}
{{- default (printf "%s-daemons" (include "weightcache.fullname" .)) .Values.daemons.namespace -}}
{{- end -}}

{{- define "weightcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weightcache.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name: set it to an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "weightcache.peering" -}}
{{- default (include "weightcache.fullname" .) .Values.operator.peering -}}
{{- end -}}

{{/* The webhook's Service DNS names, the ones the API server may use to reach it. */}}
{{- define "weightcache.webhookDNSNames" -}}
{{- $svc := include "weightcache.webhookService" . -}}
{{- $ns := .Release.Namespace -}}
{{- toJson (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) -}}
{{- end -}}

{{/* The namespaces the webhooks serve: all but the release's own (the operator must be
able to start while its webhook is down), the daemons', and webhook.excludeNamespaces. */}}
{{- define "weightcache.webhookNamespaces" -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values:
      {{- toYaml (concat (list .Release.Namespace (include "weightcache.daemonNamespace" .)) .Values.webhook.excludeNamespaces | uniq) | nindent 6 }}
{{- end -}}

{{/* Labels. */}}
{{- define "weightcache.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "weightcache.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/*
An image reference: (dict "root" $ "image" .Values.operator.image) ->
[registry/]repository:tag, the tag falling back to image.tag, then to appVersion.
*/}}
{{- define "weightcache.image" -}}
{{- $root := .root -}}
{{- $tag := .image.tag | default $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- $repo := .image.repository -}}
{{- with $root.Values.image.registry -}}
{{- $repo = printf "%s/%s" (trimSuffix "/" .) $repo -}}
{{- end -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/*
The self-managed webhook TLS material as YAML {ca, crt, key} (base64 PEM), for the
Secret, the webhook's caBundle and the Deployment's checksum alike:
- read back from the existing Secret when it holds all three, so an upgrade keeps the
  CA the API server already trusts (lookup returns nothing under `helm template`);
- otherwise a new CA and a serving certificate for the Service's DNS names.
It is computed once per render and memoised in .Values: the three templates that use
it must agree, and a second genCA would give a different CA.
*/}}
{{- define "weightcache.webhookTLS" -}}
{{- if not (hasKey .Values "__webhookTLS") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "weightcache.tlsSecret" .) -}}
{{- $ca := dig "data" "ca.crt" "" $existing -}}
{{- $crt := dig "data" "tls.crt" "" $existing -}}
{{- $key := dig "data" "tls.key" "" $existing -}}
{{- if not (and $ca $crt $key) -}}
{{- $days := int .Values.webhook.tls.validityDays -}}
{{- $authority := genCA (printf "%s-webhook-ca" (include "weightcache.fullname" .)) $days -}}
{{- $dns := include "weightcache.webhookDNSNames" . | fromJsonArray -}}
{{- $cert := genSignedCert (index $dns 2) nil $dns $days $authority -}}
{{- $ca = $authority.Cert | b64enc -}}
{{- $crt = $cert.Cert | b64enc -}}
{{- $key = $cert.Key | b64enc -}}
{{- end -}}
{{- $_ := set .Values "__webhookTLS" (dict "ca" $ca "crt" $crt "key" $key) -}}
{{- end -}}
{{- toYaml (get .Values "__webhookTLS") -}}
{{- end -}}
